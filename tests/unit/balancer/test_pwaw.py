from __future__ import annotations

from typing import Any

import pytest
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng

from stargate.balancer import (
    Algorithm,
    AlgorithmDefinition,
    Candidate,
    Comparator,
    Selected,
    Unavailable,
    Wait,
    build_policy,
)
from stargate.balancer.pulsar import PulsarRanker
from stargate.balancer.settings import Policy
from stargate.balancer.types import Choice
from stargate.errors import ConfigError

KEY = "band-key"
ROOMY: dict[str, Any] = {"kv_free": 10_000, "kv_capacity": 20_000}


def _pwaw(**settings: Any) -> Policy:
    return build_policy(AlgorithmDefinition(Algorithm.PULSAR_WAIT_AND_WIDEN, seed="seed-1", **settings))


def _ranked(
    count: int, by_rank: dict[int, dict[str, Any]], default: dict[str, Any] | None = None
) -> tuple[Candidate, ...]:
    """``count`` equal-throughput clusters; ``by_rank`` (1-based Pulsar rank) sets their stats."""
    names = [f"inst-{i}" for i in range(count)]
    plain = tuple(make_candidate(name) for name in names)
    order = PulsarRanker("seed-1").ranking(plain, make_request(key=KEY))
    rank_of = {index: position + 1 for position, index in enumerate(order)}
    return tuple(
        make_candidate(name, **{**(default or {}), **by_rank.get(rank_of[i], {})})
        for i, name in enumerate(names)
    )


def _rank(candidates: tuple[Candidate, ...], cluster_id: str) -> int:
    order = PulsarRanker("seed-1").ranking(candidates, make_request(key=KEY))
    return 1 + [candidates[i].cluster_id for i in order].index(cluster_id)


def test_b73_primary_without_slo_even_when_full() -> None:
    candidates = _ranked(3, {1: {"running": 5, "max_concurrency": 1, "queue_map": {0: 9999}}})
    decision = _pwaw().decide(candidates, make_request(key=KEY), rng())
    assert chosen(decision).rank_depth == 1
    assert _rank(candidates, chosen_id(candidates, decision)) == 1


def test_b74_bands_widen_by_least_queue() -> None:
    policy = _pwaw(queue_slo_ms=(100, 100))
    fast_rank4 = {"rtt_ms": 0.0, "queue_map": {0: 0}}
    candidates = _ranked(
        5, {1: {"queue_map": {0: 100}}, 2: {"queue_map": {0: 10}}, 3: {"queue_map": {0: 20}}, 4: fast_rank4}
    )
    assert chosen(policy.decide(candidates, make_request(key=KEY), rng())).rank_depth == 1
    over = _ranked(
        5, {1: {"queue_map": {0: 101}}, 2: {"queue_map": {0: 10}}, 3: {"queue_map": {0: 20}}, 4: fast_rank4}
    )
    for seed in range(10):
        assert chosen(policy.decide(over, make_request(key=KEY), rng(seed))).rank_depth == 2
    wider = _ranked(
        5,
        {
            1: {"queue_map": {0: 101}},
            2: {"queue_map": {0: 150}},
            3: {"queue_map": {0: 150}},
            4: {"queue_map": {0: 15}},
        },
        default={"queue_map": {0: 5}},
    )
    assert chosen(policy.decide(wider, make_request(key=KEY), rng())).rank_depth == 5


def test_least_queue_ties_break_on_relative_load() -> None:
    policy = _pwaw(queue_slo_ms=(100, 100))
    busy = {"running": 3, "max_concurrency": 4, "queue_map": {0: 10}}
    light = {"running": 2, "max_concurrency": 8, "queue_map": {0: 10}}
    candidates = _ranked(3, {1: {"queue_map": {0: 500}}, 2: busy, 3: light})
    for seed in range(10):
        assert chosen(policy.decide(candidates, make_request(key=KEY), rng(seed))).rank_depth == 3
    # With an unknown limit on either side the raw running count decides (no free slot on either).
    policy = _pwaw(queue_slo_ms=(100, 100), max_queued=5)
    over_limit = {"running": 9, "max_concurrency": 8, "queue_map": {0: 10}}
    unknown_limit = {"running": 1, "queue_map": {0: 10}}
    for by_rank, depth in (({2: unknown_limit, 3: over_limit}, 2), ({2: over_limit, 3: unknown_limit}, 3)):
        candidates = _ranked(3, {1: {"queue_map": {0: 500}}, **by_rank})
        for seed in range(10):
            assert chosen(policy.decide(candidates, make_request(key=KEY), rng(seed))).rank_depth == depth


def test_b75_kv_infeasible_primary_widens_with_flag() -> None:
    policy = _pwaw(consider_kv_free_tokens=True)
    request = make_request(key=KEY, input_tokens=500)
    small = {"kv_free": 100, "kv_capacity": 1000}
    candidates = _ranked(
        4, {1: small, 2: {**ROOMY, "queue_map": {0: 1}}, 3: {**ROOMY, "queue_map": {0: 2}}}, ROOMY
    )
    decision = policy.decide(candidates, request, rng())
    assert chosen(decision).rank_depth == 2 and chosen(decision).selected_after_kv_free_tokens_skip
    second_small = _ranked(4, {1: small, 2: small}, ROOMY)
    decision = policy.decide(second_small, request, rng())
    assert chosen(decision).rank_depth == 3 and chosen(decision).selected_after_kv_free_tokens_skip


def test_kv_flag_only_for_higher_ranked_skips() -> None:
    policy = _pwaw(consider_kv_free_tokens=True, queue_slo_ms=(100, 100))
    request = make_request(key=KEY, input_tokens=500)
    candidates = _ranked(
        3, {1: {**ROOMY, "queue_map": {0: 500}}, 2: ROOMY, 3: {"kv_free": 1, "kv_capacity": 10}}, ROOMY
    )
    decision = policy.decide(candidates, request, rng())
    assert decision == Selected(
        Choice(chosen(decision).index, rank_depth=2, selected_after_kv_free_tokens_skip=False)
    )


def test_time_locked_band_waits() -> None:
    policy = _pwaw(queue_slo_ms=(1000, 1000))
    full = {"running": 1, "max_concurrency": 1}
    candidates = _ranked(3, {1: full, 2: {**full, "rtt_ms": 0.0}, 3: {"rtt_ms": 80.0}})
    decision = policy.decide(candidates, make_request(key=KEY), rng())
    assert isinstance(decision, Wait) and decision.ms == pytest.approx(20.0)
    opened = policy.decide(candidates, make_request(key=KEY, elapsed_ms=20.0), rng())
    assert chosen(opened).rank_depth == 3


def test_nothing_selectable() -> None:
    full = {"running": 1, "max_concurrency": 1}
    candidates = _ranked(3, {}, full)
    assert isinstance(
        _pwaw(queue_slo_ms=(5, 5)).decide(candidates, make_request(key=KEY), rng()), Unavailable
    )
    assert isinstance(
        _pwaw().decide((make_candidate("x", tps=0.0),), make_request(key=KEY), rng()), Unavailable
    )
    assert isinstance(_pwaw().decide((), make_request(key=KEY), rng()), Unavailable)
    excluded = {c.cluster_id for c in candidates}
    assert isinstance(
        _pwaw().decide(candidates, make_request(key=KEY, excluded=excluded), rng()), Unavailable
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"comparator": Comparator.TTFT}, "comparator is not supported for pulsar-wait-and-widen"),
        ({"cache_affinity_wait_ms": 100}, "cache_affinity_wait_ms"),
        ({"cache_affinity_input_tokens_scale": 0.5}, "cache_affinity_input_tokens_scale"),
    ],
)
def test_b6_b19_unsupported_settings(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _pwaw(**settings)


def test_b19_defaults_are_accepted() -> None:
    _pwaw(cache_affinity_wait_ms=0, cache_affinity_input_tokens_scale=1.0)
