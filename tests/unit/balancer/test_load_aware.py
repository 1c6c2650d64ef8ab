"""Load-aware estimates and options (lb-config ``load_aware``, ``cache_affinity_yield_margin_ms``,
``cache_affinity_placement``).

Below the slot limit the seed's free-slot rule gives every backend with a free slot the same queue
estimate (0); the load-aware estimates must tell the busy one from the idle one, merging the
published stats with the router's own in-flight count without double counting.
"""

from __future__ import annotations

import dataclasses
import math
import random
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng, waw

from stargate.balancer import Algorithm, AlgorithmDefinition, Candidate, Comparator, build_policy
from stargate.balancer.comparators import load_ttft_score, ttft_score
from stargate.balancer.config import parse_lb_config
from stargate.balancer.estimates import (
    UNKNOWN_PREFILL_TPS,
    effective_queue_ms,
    expected_queue_ms,
    load_queue_ms,
    load_running,
    load_tie_key,
    load_ttft_ms,
    shared_prefill_tokens,
    sharing_queue_ms,
    slot_hold_s,
    slot_wait_ms,
    with_assumed_rates,
)
from stargate.balancer.settings import Placement, PrefillEstimate, PrefillRate
from stargate.balancer.types import UNAVAILABLE, AffinityRoute, InFlight, Wait
from stargate.balancer.wait_and_widen import Ranking, WawSelector
from stargate.balancer.wait_and_widen_affinity import PLACED_CAPACITY, RESIDENCY, AffinityGroups
from stargate.errors import ConfigError


def with_in_flight(candidate: Candidate, requests: int, prefilling: int, tokens: int) -> Candidate:
    return dataclasses.replace(candidate, in_flight=InFlight(requests, prefilling, tokens))


def pon(**settings: Any) -> AlgorithmDefinition:
    settings.setdefault("comparator", Comparator.TTFT)
    return AlgorithmDefinition(Algorithm.POWER_OF_N, **settings)


# ---- estimates ------------------------------------------------------------------------------------


def test_the_expected_queue_header_sees_this_routers_requests_under_load_aware() -> None:
    # 2 of 4 slots taken as published; this router's own count decides when it is larger.
    candidate = make_candidate("a", tps=1000.0, max_concurrency=4, running=2, queued=500)
    assert expected_queue_ms(candidate, 0) == expected_queue_ms(candidate, 0, load_aware=True) == 0
    assert expected_queue_ms(with_in_flight(candidate, 3, 3, 300), 0, load_aware=True) == 0
    full = with_in_flight(candidate, 4, 3, 2500)
    assert expected_queue_ms(full, 0) == 0  # the spec's rule: published stats only
    assert expected_queue_ms(full, 0, load_aware=True) == 2500  # 2500 tokens ahead at 1000 tok/s
    # Full with nothing ahead (every slot decoding): still not the 0 that promises a free slot.
    decoding = make_candidate("a", tps=1000.0, max_concurrency=4, running=4, queued=0)
    assert expected_queue_ms(decoding, 0) == 0
    assert expected_queue_ms(decoding, 0, load_aware=True) == 1
    # Without a usable rate the load-aware queue is unknown: the spec's estimate stands.
    unknown = with_in_flight(make_candidate("a", tps=0.0, max_concurrency=4, running=4, queued=5), 4, 1, 9)
    assert expected_queue_ms(unknown, 0, load_aware=True) is None


def _expected_cached(*, whole: bool) -> Candidate:
    """A 1-slot cluster at 1000 tok/s prefilling one 1000-token prompt expected 90% cached, still a
    pending reservation; with ``whole`` its Pylon counts whole prompts (no ``CACHED_PROMPT_WORK``)."""
    discounted = make_candidate("a", tps=1000.0, max_concurrency=1, running=1, queue_size=1, queued=100)
    if not whole:
        return dataclasses.replace(discounted, in_flight=InFlight(1, 1, 100))
    counted = dataclasses.replace(discounted.stats, queued_input_size=1000)
    return dataclasses.replace(
        discounted, pylon_stats=counted, in_flight=InFlight(1, 1, 100, cached_tokens=900)
    )


def test_the_header_counts_a_prompt_expected_cached_as_its_pylon_does() -> None:
    """Spec §3.10: the header is never scaled. Pylon counts the whole prompt of a pick expected
    cached, so the header does too (100 had Pylon reject a key's follow-up), unless Pylon leaves
    the cache out itself; the load-aware ranking keeps counting the uncached part."""
    whole = _expected_cached(whole=True)
    assert expected_queue_ms(whole, 0) == expected_queue_ms(whole, 0, load_aware=True) == 1000
    assert load_queue_ms(whole, 0) == 100
    cached = _expected_cached(whole=False)
    assert expected_queue_ms(cached, 0) == expected_queue_ms(cached, 0, load_aware=True) == 100
    # Counted by a heartbeat already, only this router's own count still says it is whole.
    own = dataclasses.replace(whole, pylon_stats=None)
    assert expected_queue_ms(own, 0, load_aware=True) == 1000


def test_the_queue_slo_filter_counts_a_prompt_expected_cached_as_its_pylon_does() -> None:
    """A 500 ms queue SLO passes the 100 ms the ranking counts, not the 1000 ms Pylon counts."""
    request = make_request(input_tokens=100)
    for load_aware in (False, True):
        policy = build_policy(waw(load_aware=load_aware, max_queued=5, queue_slo_ms=(500, 500)))
        cached = (_expected_cached(whole=False),)
        assert chosen_id(cached, policy.decide(cached, request, rng())) == "a"
        whole = (_expected_cached(whole=True),)
        assert policy.decide(whole, request, rng()) == UNAVAILABLE  # 1000 ms queued: over the SLO


def test_free_slot_hides_prefill_backlog_but_load_estimate_sees_it() -> None:
    busy = make_candidate("busy", tps=1000.0, queued=2000, running=1, max_concurrency=8)
    assert effective_queue_ms(busy.stats, 0) == 0  # the seed's rule: a free slot, no queue
    assert load_queue_ms(busy, 0) == 2000.0  # 2000 tokens ahead at 1000 tok/s


def test_own_in_flight_prefill_counts_when_published_stats_lag() -> None:
    stale = make_candidate("a", tps=1000.0, queued=0, running=0, max_concurrency=8)
    assert load_queue_ms(with_in_flight(stale, 3, 2, 500), 0) == 500.0


def test_published_and_own_counts_merge_by_max_not_sum() -> None:
    counted = make_candidate("a", tps=1000.0, queued=800, running=3, max_concurrency=8)
    merged = with_in_flight(counted, 3, 2, 500)
    assert load_queue_ms(merged, 0) == 800.0
    assert load_running(merged) == 3
    assert load_running(with_in_flight(counted, 5, 1, 100)) == 5


def test_at_the_slot_limit_the_larger_of_spec_and_load_estimate_applies() -> None:
    full = make_candidate("a", tps=100.0, queued=10, running=8, max_concurrency=8, queue_map={0: 900})
    assert load_queue_ms(full, 0) == 900.0  # the engine's priority map says more than the backlog
    own_full = with_in_flight(make_candidate("b", tps=100.0, running=0, max_concurrency=2), 2, 2, 50)
    assert load_queue_ms(own_full, 0) == 500.0  # full by the router's own count: backlog estimate


def test_unknown_throughput_with_backlog_is_infinite_and_idle_is_zero() -> None:
    assert load_queue_ms(make_candidate("a", tps=0.0, queued=5), 0) == float("inf")
    assert load_queue_ms(make_candidate("a", tps=0.0), 0) == 0.0


def test_a_cluster_without_a_published_rate_is_assumed_at_the_others_mean() -> None:
    known = (make_candidate("a", tps=1000.0), make_candidate("b", tps=3000.0))
    assert with_assumed_rates(known) is known
    mixed = with_assumed_rates((*known, make_candidate("c", tps=0.0, queued=400)))
    assert [c.assumed_input_tps for c in mixed] == [0.0, 0.0, 2000.0]
    assert load_queue_ms(mixed[2], 0) == 200.0  # 400 tokens at 2000 tokens/s, not infinite
    assert ttft_score(mixed[2], 0, 100) == float("inf")  # the seed's estimate never reads it
    nothing = with_assumed_rates((make_candidate("a", tps=0.0), make_candidate("b", tps=float("nan"))))
    assert [c.assumed_input_tps for c in nothing] == [UNKNOWN_PREFILL_TPS] * 2


def test_a_fleet_that_publishes_no_rate_is_routed_by_the_work_ahead_under_load_aware() -> None:
    """Pylon publishes 0 until it has measured a rate from the answers it relays; the seed's
    estimate takes the prefill for infinite and never sends the request that would measure it."""
    candidates = with_assumed_rates(
        (
            make_candidate("busy", tps=0.0, queued=800, max_concurrency=8),
            make_candidate("idle", tps=0.0, max_concurrency=8),
        )
    )
    request = make_request(input_tokens=100)
    assert build_policy(waw(n=2)).decide(candidates, request, rng()) == UNAVAILABLE
    for seed in range(10):
        for definition in (waw(n=2, load_aware=True), pon(n=2, load_aware=True)):
            assert (
                chosen_id(candidates, build_policy(definition).decide(candidates, request, rng(seed)))
                == "idle"
            )


def test_load_ttft_adds_rtt_backlog_and_scaled_prefill() -> None:
    candidate = make_candidate("a", rtt_ms=3.0, tps=1000.0, queued=1000, running=1, max_concurrency=4)
    assert load_ttft_ms(candidate, 500, 0) == 3.0 + 1000.0 + 500.0
    assert load_ttft_ms(candidate, 500, 0, scale=0.2) == 3.0 + 1000.0 + 100.0
    assert load_ttft_score(candidate, 0, 500) == 1503.0
    assert ttft_score(candidate, 0, 500) == 503.0  # seed estimate: free slot, no queue


def test_tie_key_treats_estimates_within_resolution_as_equal_then_prefers_fewer_running() -> None:
    assert load_tie_key(3.0, 1, 20.0) < load_tie_key(1.0, 4, 20.0)
    assert load_tie_key(1.0, 4, 20.0) < load_tie_key(21.0, 0, 20.0)
    assert load_tie_key(5.0, 1, 0.0) < load_tie_key(6.0, 0, 0.0)


# ---- power-of-n -----------------------------------------------------------------------------------


def _idle_and_busy(**busy: Any) -> tuple[Candidate, ...]:
    idle = make_candidate("idle", rtt_ms=1.2, tps=1000.0, running=0, max_concurrency=8)
    loaded = make_candidate("busy", rtt_ms=1.0, tps=1000.0, max_concurrency=8, **busy)
    return (idle, loaded)


def test_power_of_n_seed_estimate_cannot_see_load_below_the_slot_limit() -> None:
    candidates = _idle_and_busy(queued=4000, running=4)
    policy = build_policy(pon())
    picks = {
        chosen_id(candidates, policy.decide(candidates, make_request(input_tokens=100), rng(s)))
        for s in range(20)
    }
    assert picks == {"busy"}  # rtt noise decides: the busy one is 0.2 ms closer


def test_power_of_n_load_aware_avoids_prefill_backlog() -> None:
    candidates = _idle_and_busy(queued=4000, running=4)
    policy = build_policy(pon(load_aware=True))
    for seed in range(20):
        assert (
            chosen_id(candidates, policy.decide(candidates, make_request(input_tokens=100), rng(seed)))
            == "idle"
        )


def test_power_of_n_load_aware_prefers_fewer_decoding_when_prefill_ties() -> None:
    candidates = _idle_and_busy(running=6)  # no backlog, six requests decoding
    policy = build_policy(pon(load_aware=True))
    for seed in range(20):
        assert (
            chosen_id(candidates, policy.decide(candidates, make_request(input_tokens=100), rng(seed)))
            == "idle"
        )


def test_power_of_n_load_aware_breaks_exact_ties_at_random() -> None:
    a = make_candidate("a", tps=1000.0, max_concurrency=8)
    b = make_candidate("b", tps=1000.0, max_concurrency=8)
    policy = build_policy(pon(load_aware=True))
    picks = [chosen_id((a, b), policy.decide((a, b), make_request(), random.Random(s))) for s in range(200)]
    assert 60 < picks.count("a") < 140


@pytest.mark.parametrize("definition", [pon(load_aware=True), waw(n=2, load_aware=True)])
def test_load_aware_ties_within_a_step_are_not_decided_by_rtt(definition: AlgorithmDefinition) -> None:
    """Two idle backends 1.2 and 5.6 ms away, estimates in one 20 ms step: a coin, not the closer
    one every time."""
    near = make_candidate("near", rtt_ms=1.2, tps=1000.0, max_concurrency=8)
    far = make_candidate("far", rtt_ms=5.6, tps=1000.0, max_concurrency=8)
    policy = build_policy(definition)
    picks = [
        chosen_id((near, far), policy.decide((near, far), make_request(), random.Random(s)))
        for s in range(200)
    ]
    assert 60 < picks.count("near") < 140


def test_power_of_n_load_aware_sees_its_own_in_flight_burst() -> None:
    """Stale stats say both are idle; the router's own in-flight count says one has a burst."""
    a = make_candidate("a", tps=1000.0, max_concurrency=8)
    b = make_candidate("b", tps=1000.0, max_concurrency=8)
    candidates = (with_in_flight(a, 4, 4, 4000), b)
    policy = build_policy(pon(load_aware=True))
    for seed in range(20):
        assert chosen_id(candidates, policy.decide(candidates, make_request(), rng(seed))) == "b"


# ---- wait-and-widen -------------------------------------------------------------------------------


def test_waw_load_aware_ranks_by_backlog_below_the_slot_limit() -> None:
    candidates = _idle_and_busy(queued=4000, running=4)
    seed_policy = build_policy(waw(n=2))
    load_policy = build_policy(waw(n=2, load_aware=True))
    request = make_request(input_tokens=100)
    assert {chosen_id(candidates, seed_policy.decide(candidates, request, rng(s))) for s in range(20)} == {
        "busy"
    }
    for seed in range(20):
        assert chosen_id(candidates, load_policy.decide(candidates, request, rng(seed))) == "idle"


def test_waw_load_aware_capacity_counts_own_in_flight() -> None:
    """Published stats show a free slot, but the router itself has the engine's limit in flight."""
    full = with_in_flight(make_candidate("a", tps=1000.0, running=0, max_concurrency=2), 2, 0, 0)
    other = make_candidate("b", rtt_ms=50.0, tps=1000.0, running=1, max_concurrency=2)
    policy = build_policy(waw(n=2, load_aware=True, ttft_bucket_size_ms=100))
    assert chosen_id((full, other), policy.decide((full, other), make_request(), rng())) == "b"


def _sample_picks(times: int, **running: int) -> list[str]:
    """Load-aware wait-and-widen (``n`` 2) picks on idle-estimated backends running ``running``."""
    candidates = tuple(
        make_candidate(name.replace("_", "-"), tps=1000.0, running=count, max_concurrency=16)
        for name, count in running.items()
    )
    policy = build_policy(waw(n=2, load_aware=True))
    request = make_request(input_tokens=500)
    return [chosen_id(candidates, policy.decide(candidates, request, rng(s))) for s in range(times)]


def test_waw_load_aware_compares_the_samples_ties_with_the_whole_open_bucket() -> None:
    """Four equal idle backends: a sample of two leaves the one with fewest running out half the
    time; the tie is exact (same estimate step), so every cluster in it is compared."""
    assert set(_sample_picks(100, busy_a=6, busy_b=5, light=1, busy_c=6)) == {"light"}


def test_waw_load_aware_equal_ties_fall_to_a_coin() -> None:
    """Two backends equally light and equally estimated share the picks, wherever the sample fell."""
    picks = _sample_picks(1000, busy_a=6, light_a=1, busy_b=6, busy_c=6, light_b=1)
    assert set(picks) == {"light-a", "light-b"}
    assert 420 <= picks.count("light-a") <= 580


def test_waw_load_aware_sample_still_decides_between_different_estimates() -> None:
    """Only ties join the comparison: a sample holding no tie of the lowest estimate keeps its own
    best, so estimates that differ are still hedged by the sample (not a least-work pick)."""
    candidates = (
        make_candidate("low", tps=1000.0, queued=0, running=9, max_concurrency=16),
        make_candidate("higher-busy", rtt_ms=60.0, tps=1000.0, running=4, max_concurrency=16),
        make_candidate("higher-light", rtt_ms=60.0, tps=1000.0, running=0, max_concurrency=16),
    )
    policy = build_policy(waw(n=2, load_aware=True, ttft_bucket_size_ms=20, next_bucket_unlock_factor=0.0))
    request = make_request(input_tokens=500)
    picks = {chosen_id(candidates, policy.decide(candidates, request, rng(s))) for s in range(100)}
    assert picks == {"low", "higher-light"}


def test_waw_load_aware_keeps_free_slot_rule_for_the_queue_slo_filter() -> None:
    """A busy backend with a free slot passes a 0 ms queue SLO (the seed's rule), and still wins
    when it is the only one."""
    busy = make_candidate("busy", tps=1000.0, queued=4000, running=1, max_concurrency=8)
    policy = build_policy(waw(load_aware=True, queue_slo_ms=(0, 0)))
    assert chosen_id((busy,), policy.decide((busy,), make_request(), rng())) == "busy"


# ---- affinity that yields to load ------------------------------------------------------------------


def _affinity_policy(margin: int | None, **settings: Any) -> Any:
    defaults: dict[str, Any] = {
        "selection_count": 1,
        "virtual_nodes": 8,
        "seed": "seed-1",
        "cache_affinity_wait_ms": 200,
        "cache_affinity_input_tokens_scale": 0.2,
        "cache_affinity_yield_margin_ms": margin,
        "load_aware": True,
    }
    return build_policy(waw(**{**defaults, **settings}))


def _ring(c_queued: int) -> tuple[Candidate, ...]:
    # Key prefix-a maps to affinity-c with a group of one (Appendix A).
    return (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-c", tps=1000.0, queued=c_queued, running=2, max_concurrency=8),
    )


def test_affinity_yields_when_its_estimate_is_worse_by_more_than_the_margin() -> None:
    candidates = _ring(c_queued=3000)  # affine: 3000 + 0.2 x 1000 = 3200 ms; global best 1000 ms
    decision = _affinity_policy(margin=500).decide(
        candidates, make_request(input_tokens=1000, key="prefix-a"), rng()
    )
    assert chosen_id(candidates, decision) in {"affinity-a", "affinity-b"}
    assert chosen(decision).rank_depth == 2


def test_affinity_holds_within_the_margin() -> None:
    candidates = _ring(c_queued=1200)  # affine 1400 ms vs global 1000 ms: within a 500 ms margin
    decision = _affinity_policy(margin=500).decide(
        candidates, make_request(input_tokens=1000, key="prefix-a"), rng()
    )
    assert chosen_id(candidates, decision) == "affinity-c"
    assert chosen(decision).rank_depth == 1
    assert chosen(decision).prefill_tokens == 200  # 0.2 x 1000: the work the estimate assumed


def test_a_seed_affinity_pick_reports_the_whole_prompt() -> None:
    candidates = _ring(c_queued=0)
    seed = build_policy(
        waw(selection_count=1, virtual_nodes=8, seed="seed-1", cache_affinity_input_tokens_scale=0.2)
    )
    decision = seed.decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(candidates, decision) == "affinity-c"
    assert chosen(decision).prefill_tokens is None


def test_without_a_margin_the_seed_hold_applies() -> None:
    candidates = _ring(c_queued=3000)
    decision = _affinity_policy(margin=None).decide(
        candidates, make_request(input_tokens=1000, key="prefix-a"), rng()
    )
    assert chosen_id(candidates, decision) == "affinity-c"  # free slot: the group selects


def test_full_affinity_group_yields_before_x_when_the_wait_costs_more_than_the_margin() -> None:
    candidates = (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-c", tps=1000.0, queued=5000, running=8, max_concurrency=8),
    )
    request = make_request(input_tokens=1000, key="prefix-a", elapsed_ms=10.0)
    decision = _affinity_policy(margin=500).decide(candidates, request, rng())
    assert chosen(decision).rank_depth == 2


def test_a_move_is_charged_the_cached_prefill_it_repeats() -> None:
    # Group: 2000 + 0.2 x 1000 = 2200 ms. Idle a or b: 1000 ms of prefill, of which the 800 ms the
    # group holds cached are repeated there: 1800 ms, plus the 500 ms margin: the group holds...
    request = make_request(input_tokens=1000, key="prefix-a")
    holds = _ring(c_queued=2000)
    assert chosen_id(holds, _affinity_policy(margin=500).decide(holds, request, rng())) == "affinity-c"
    # ... until it is worse than that: 2700 ms.
    yields = _ring(c_queued=2500)
    decision = _affinity_policy(margin=500).decide(yields, request, rng())
    assert chosen_id(yields, decision) in {"affinity-a", "affinity-b"}


def _full(cluster_id: str, queued: int) -> Candidate:
    return make_candidate(cluster_id, tps=1000.0, queued=queued, running=8, max_concurrency=8)


def test_affinity_holds_when_every_other_backend_is_at_its_slot_limit() -> None:
    # a and b could still queue (max_queued 4) and their estimates (500 ms queued + 1800 ms charged
    # prefill) beat the group's (3000 + 200 ms) by more than the margin, but a move would only trade
    # queues: the group holds.
    candidates = (_full("affinity-a", 500), _full("affinity-b", 500), _ring(c_queued=3000)[2])
    policy = _affinity_policy(margin=500, max_queued=4)
    for seed in range(10):
        decision = policy.decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng(seed))
        assert chosen_id(candidates, decision) == "affinity-c"
        assert chosen(decision).rank_depth == 1


def test_affinity_yields_to_a_backend_with_a_free_slot_not_to_a_queue() -> None:
    free_b = make_candidate("affinity-b", tps=1000.0, queued=1000, running=2, max_concurrency=8)
    candidates = (_full("affinity-a", 0), free_b, _ring(c_queued=4000)[2])
    for seed in range(10):
        policy = _affinity_policy(margin=500, max_queued=4)  # fresh: the key follows a yield
        decision = policy.decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng(seed))
        assert chosen_id(candidates, decision) == "affinity-b"  # a's 1000 ms estimate is a queue
        assert chosen(decision).rank_depth == 2


@settings(max_examples=150, deadline=None)
@given(
    group_queued=st.integers(0, 5000),
    prefilling=st.lists(st.integers(1, 3000), max_size=3),
    others=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 10)), min_size=1, max_size=3),
    margin=st.integers(0, 3000),
    scale=st.sampled_from([0.0, 0.2, 1.0]),
    sharing=st.booleans(),
)
def test_the_yield_check_reads_the_fleet_only_where_the_fleet_could_win(
    group_queued: int,
    prefilling: list[int],
    others: list[tuple[int, int]],
    margin: int,
    scale: float,
    sharing: bool,
) -> None:
    """A group estimated within the margin holds without reading the other clusters; the answer is
    the comparison with the best of them, whichever way it is reached."""
    sizes = tuple(sorted(prefilling))
    group = dataclasses.replace(
        make_candidate("g", tps=1000.0, queued=group_queued, running=2, max_concurrency=8),
        in_flight=InFlight(len(sizes), len(sizes), sum(sizes), prefill_sizes=sizes),
    )
    rest = tuple(
        make_candidate(f"o{i}", tps=1000.0, queued=queued, running=running, max_concurrency=8)
        for i, (queued, running) in enumerate(others)
    )
    candidates = (group, *rest)
    policy = _affinity_policy(margin, cache_affinity_input_tokens_scale=scale, prefill_sharing=sharing)
    request = make_request(input_tokens=100, key="prefix-a")
    selector = policy._selector
    affine = selector.best_ttft(candidates, (0,), request, scale, None, free_slot_only=False)
    public = selector.best_ttft(candidates, None, request, 2.0 - scale, None, free_slot_only=True)
    expected = public < math.inf and affine > public + margin
    assert policy._affinity_loses(candidates, request, (0,), scale, None) is expected


# ---- property: below the slot limit the less-loaded of two equal backends wins more often -----------

loads = st.integers(min_value=0, max_value=20_000)


@settings(max_examples=60, deadline=None)
@given(
    light=loads,
    extra=st.integers(min_value=200, max_value=20_000),
    rtt_a=st.floats(0.5, 2.0),
    seed=st.integers(0, 2**32),
)
def test_less_loaded_of_two_equal_backends_wins_more_often(
    light: int, extra: int, rtt_a: float, seed: int
) -> None:
    heavy = light + extra
    a = make_candidate("a", rtt_ms=rtt_a, tps=1000.0, queued=light, running=1, max_concurrency=8)
    b = make_candidate("b", rtt_ms=1.0, tps=1000.0, queued=heavy, running=1, max_concurrency=8)
    random_source = random.Random(seed)
    for definition in (pon(load_aware=True), waw(n=2, load_aware=True)):
        policy = build_policy(definition)
        wins = sum(
            chosen_id((a, b), policy.decide((a, b), make_request(input_tokens=500), random_source)) == "a"
            for _ in range(20)
        )
        assert wins > 10


def test_a_key_that_yielded_follows_its_cache_to_the_cluster_it_went_to() -> None:
    policy = _affinity_policy(margin=500)
    loaded = _ring(c_queued=3000)
    first = policy.decide(loaded, make_request(input_tokens=1000, key="prefix-a"), rng())
    moved_to = chosen_id(loaded, first)
    assert moved_to != "affinity-c" and chosen(first).rank_depth == 2
    # Later turns of the key stay where its KV cache now is, even once the ring member is idle.
    idle = _ring(c_queued=0)
    for seed in range(10):
        decision = policy.decide(idle, make_request(input_tokens=1000, key="prefix-a"), rng(seed))
        assert chosen_id(idle, decision) == moved_to
        assert chosen(decision).rank_depth == 1


def test_without_a_margin_a_global_pick_after_x_does_not_move_the_key() -> None:
    policy = _affinity_policy(margin=None)
    full = (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-c", tps=1000.0, running=8, max_concurrency=8),
    )
    after_x = make_request(input_tokens=1000, key="prefix-a", elapsed_ms=250.0)
    assert chosen(policy.decide(full, after_x, rng())).rank_depth == 2
    idle = _ring(c_queued=0)
    assert chosen_id(idle, policy.decide(idle, make_request(key="prefix-a"), rng())) == "affinity-c"


@settings(max_examples=100, deadline=None)
@given(
    queued=st.integers(0, 50_000),
    running=st.integers(0, 12),
    limit=st.integers(0, 8),
    own=st.tuples(st.integers(0, 12), st.integers(0, 50_000)),
    tps=st.sampled_from([500.0, 1000.0]),
    qmap=st.sampled_from([{}, {0: 700}]),
    reference_queued=st.integers(0, 50_000),
)
def test_the_flat_waw_ranking_follows_the_load_ttft_estimate(
    queued: int,
    running: int,
    limit: int,
    own: tuple[int, int],
    tps: float,
    qmap: dict[int, int],
    reference_queued: int,
) -> None:
    """wait-and-widen inlines the load-aware estimates: with every bucket open and no tie
    resolution its pick must be the lower ``load_ttft_ms``."""
    candidate = with_in_flight(
        make_candidate("a", tps=tps, queued=queued, running=running, max_concurrency=limit, queue_map=qmap),
        own[0],
        min(own[0], 1),
        own[1],
    )
    reference = make_candidate("b", tps=1000.0, queued=reference_queued)
    a, b = load_ttft_ms(candidate, 300, 0), load_ttft_ms(reference, 300, 0)
    assume(a != b and (limit == 0 or load_running(candidate) < limit))  # a has capacity
    policy = build_policy(waw(n=2, load_aware=True, ttft_bucket_size_ms=0, next_bucket_unlock_factor=0.0))
    decision = policy.decide((candidate, reference), make_request(input_tokens=300), rng())
    assert chosen_id((candidate, reference), decision) == ("a" if a < b else "b")


# ---- placement of a new key by load ----------------------------------------------------------------


def _placing_policy() -> Any:
    return _affinity_policy(margin=250, cache_affinity_placement=Placement.LOAD)


def test_a_new_key_is_placed_on_the_least_loaded_backend_not_its_ring_member() -> None:
    # prefix-a's ring member is affinity-c; placed by load it goes to the idle affinity-b.
    candidates = (
        make_candidate("affinity-a", tps=1000.0, queued=900, running=3, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-c", tps=1000.0, queued=600, running=2, max_concurrency=8),
    )
    for seed in range(10):
        decision = _placing_policy().decide(
            candidates, make_request(input_tokens=1000, key="prefix-a"), rng(seed)
        )
        assert chosen_id(candidates, decision) == "affinity-b"
        assert chosen(decision).rank_depth == 1


def test_a_placed_key_stays_on_its_backend_within_the_margin() -> None:
    policy = _placing_policy()
    idle_b = (
        make_candidate("affinity-a", tps=1000.0, queued=900, running=3, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
    )
    assert (
        chosen_id(idle_b, policy.decide(idle_b, make_request(input_tokens=1000, key="k"), rng()))
        == "affinity-b"
    )
    # b is now busier than a, but the cached 0.2 x prefill keeps the key there within 250 ms.
    busy_b = (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, queued=700, running=2, max_concurrency=8),
    )
    decision = policy.decide(busy_b, make_request(input_tokens=1000, key="k"), rng())
    assert chosen_id(busy_b, decision) == "affinity-b"
    assert chosen(decision).rank_depth == 1


def test_a_placed_key_follows_a_global_pick_after_x_without_a_margin() -> None:
    policy = _affinity_policy(margin=None, cache_affinity_placement=Placement.LOAD)
    idle_b = (
        make_candidate("affinity-a", tps=1000.0, queued=900, running=3, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
    )
    first = policy.decide(idle_b, make_request(input_tokens=1000, key="k"), rng())
    assert chosen_id(idle_b, first) == "affinity-b"
    full_b = (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, running=8, max_concurrency=8),
    )
    before_x = policy.decide(full_b, make_request(input_tokens=1000, key="k", elapsed_ms=50.0), rng())
    assert isinstance(before_x, Wait)  # no margin: the group holds until X
    after_x = policy.decide(full_b, make_request(input_tokens=1000, key="k", elapsed_ms=250.0), rng())
    assert chosen_id(full_b, after_x) == "affinity-a" and chosen(after_x).rank_depth == 2
    # The next turn extends the prompt sent to a: it goes there, not back to the idle b.
    for seed in range(5):
        decision = policy.decide(idle_b, make_request(input_tokens=1200, key="k"), rng(seed))
        assert chosen_id(idle_b, decision) == "affinity-a" and chosen(decision).rank_depth == 1


def test_a_placement_survives_membership_changes_and_ends_with_its_backend() -> None:
    policy = _placing_policy()
    two = (
        make_candidate("affinity-a", tps=1000.0, queued=900, running=3, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
    )
    assert chosen_id(two, policy.decide(two, make_request(input_tokens=1000, key="k"), rng())) == "affinity-b"
    # A backend joins in front of b (b's index changes): the key stays on b.
    three = (make_candidate("affinity-0", tps=1000.0, max_concurrency=8), *two)
    for seed in range(5):
        assert (
            chosen_id(three, policy.decide(three, make_request(input_tokens=1000, key="k"), rng(seed)))
            == "affinity-b"
        )
    # b leaves: the key is placed again by load, and stays on its new backend.
    without_b = (
        make_candidate("affinity-0", tps=1000.0, queued=5000, running=4, max_concurrency=8),
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
    )
    for seed in range(5):
        assert (
            chosen_id(
                without_b, policy.decide(without_b, make_request(input_tokens=1000, key="k"), rng(seed))
            )
            == "affinity-a"
        )


def test_placements_are_bounded_and_the_least_recently_used_is_forgotten() -> None:
    groups = AffinityGroups(waw(selection_count=1, cache_affinity_placement=Placement.LOAD), 1)
    candidates = (make_candidate("a"), make_candidate("b"))
    target = make_request().target
    groups.place("old", "a")
    for index in range(PLACED_CAPACITY - 1):
        groups.place(f"key-{index}", "b")
    assert groups.group(candidates, target, "old") == (0,)  # used: now the most recent
    groups.place("one-more", "b")
    assert groups.group(candidates, target, "old") == (0,)
    assert groups.group(candidates, target, "key-0") == ()  # the least recently used went


def test_long_keys_are_remembered_by_digest_and_stay_apart() -> None:
    """65 536 keys of 8 KB header values took the router to 645 MB."""
    groups = AffinityGroups(waw(selection_count=1, cache_affinity_placement=Placement.LOAD), 1)
    candidates = (make_candidate("a"), make_candidate("b"))
    target = make_request().target
    one, other = "k" * 8000 + "1", "k" * 8000 + "2"
    groups.place(one, "a")
    groups.learn(other, "b", 100, 1.0)  # as a Pylon's published route names it
    groups.routed(one, "a", 50, 2.0)
    assert groups.group(candidates, target, one) == (0,)
    assert groups.group(candidates, target, other) == (1,)
    assert groups.uncached_tokens(one, "a", 80) == 30
    assert max(map(len, (*groups._placed, *groups._routed))) <= 256


def test_a_spread_group_keeps_its_newest_members_and_loses_those_that_left() -> None:
    groups = AffinityGroups(waw(selection_count=1, cache_affinity_placement=Placement.LOAD), 1)
    ids = [f"c{index}" for index in range(RESIDENCY + 2)]
    candidates = tuple(make_candidate(cluster_id) for cluster_id in ids)
    target = make_request().target
    groups.place("k", "c0")
    for cluster_id in ids[1:]:
        members = groups.group(candidates, target, "k")
        groups.spread("k", tuple(ids[i] for i in members), cluster_id)
    assert groups.group(candidates, target, "k") == tuple(range(2, RESIDENCY + 2))  # the oldest went
    groups.spread("k", ("c3",), "c2")  # the group a spill left, and where it went
    assert groups.group(candidates, target, "k") == (3, 2)
    groups.spread("k", tuple(ids[2:]), "c2")  # a member spilled to again becomes the newest
    assert groups.group(candidates, target, "k")[-1] == 2
    without_c5 = tuple(c for c in candidates if c.cluster_id != "c5")
    assert len(groups.group(without_c5, target, "k")) == RESIDENCY - 1
    assert "c5" not in {without_c5[i].cluster_id for i in groups.group(without_c5, target, "k")}
    groups.place("k", "c1")  # a move (a yield, a pick after X) replaces the group
    assert groups.group(candidates, target, "k") == (1,)


def test_a_route_to_a_member_keeps_a_spread_group_and_one_elsewhere_moves_it() -> None:
    groups = AffinityGroups(waw(selection_count=1, cache_affinity_placement=Placement.LOAD), 1)
    candidates = (make_candidate("a"), make_candidate("b"), make_candidate("c"))
    target = make_request().target
    groups.place("k", "a")
    groups.routed("k", "a", 1000, 1.0)
    groups.spread("k", ("a",), "b")
    groups.routed("k", "b", 1100, 2.0)
    groups.learn("k", "a", 1200, 3.0)  # another router's request on a member
    assert groups.group(candidates, target, "k") == (0, 1)
    assert groups.uncached_tokens("k", "a", 1300) == 100  # the learned route is remembered
    assert groups.uncached_tokens("k", "b", 1300) == 200
    assert groups.uncached_tokens("k", "c", 1300) is None
    groups.learn("k", "c", 1300, 2.5)  # older than the newest route known here: ignored
    assert groups.group(candidates, target, "k") == (0, 1)
    groups.learn("k", "c", 1300, 4.0)
    assert groups.group(candidates, target, "k") == (2,)
    groups.routed("k", "c", 1400, 5.0)
    assert groups.uncached_tokens("k", "a", 1500) is None  # a left the group: its route went


def test_a_route_elsewhere_of_a_key_in_flight_here_spreads_it() -> None:
    # The key's requests run in parallel: another router spilled it, and its cache is there too.
    groups = AffinityGroups(waw(selection_count=1, cache_affinity_placement=Placement.LOAD), 1)
    candidates = (make_candidate("a"), make_candidate("b"), make_candidate("c"))
    target = make_request().target
    groups.place("k", "a")
    groups.routed("k", "a", 1000, 2.0)
    groups.learn("k", "b", 1000, 1.0, parallel=True)  # older than this router's own: still joins
    assert groups.group(candidates, target, "k") == (0, 1)
    assert groups.uncached_tokens("k", "b", 1100) == 100
    groups.learn("k", "c", 1000, 3.0)  # nothing in flight here: the key moved
    assert groups.group(candidates, target, "k") == (2,)


def test_load_placement_needs_a_group_of_one() -> None:
    with pytest.raises(ConfigError, match="cache_affinity_backend_selection_count"):
        parse_lb_config(
            {
                "models": {
                    "m": {
                        "algorithm": "wait-and-widen",
                        "cache_affinity_backend_selection_count": 2,
                        "cache_affinity_placement": "load",
                    }
                }
            }
        )
    with pytest.raises(ConfigError, match="expected one of: ring, load"):
        parse_lb_config(
            {"models": {"m": {"algorithm": "wait-and-widen", "cache_affinity_placement": "nearest"}}}
        )


# ---- prefill of the affinity group from the prompt's growth ----------------------------------------


def _growth_policy() -> Any:
    return _affinity_policy(
        margin=250, cache_affinity_placement=Placement.LOAD, cache_affinity_prefill=PrefillEstimate.GROWTH
    )


def _second_turn(policy: Any, first_tokens: int, second_tokens: int) -> tuple[tuple[Candidate, ...], Any]:
    first = (
        make_candidate("affinity-a", tps=1000.0, queued=20_000, running=3, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
    )
    placed = policy.decide(first, make_request(input_tokens=first_tokens, key="k"), rng())
    assert chosen_id(first, placed) == "affinity-b"
    # b now has 17 s of prefill ahead; a is idle, where the whole prompt would be prefilled.
    second = (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, queued=17_000, running=2, max_concurrency=8),
    )
    return second, policy.decide(second, make_request(input_tokens=second_tokens, key="k"), rng())


def test_growth_counts_only_what_the_prompt_added_since_the_keys_last_request() -> None:
    # 100 new tokens on b: 17.1 s there against 10 s on a plus the 9.9 s of cached prefill a move
    # repeats, so the key stays with its cache...
    candidates, decision = _second_turn(_growth_policy(), 9900, 10_000)
    assert chosen_id(candidates, decision) == "affinity-b"
    assert chosen(decision).rank_depth == 1
    assert chosen(decision).prefill_tokens == 100  # ... and b is charged the growth, not 2000
    # The scaled estimate (0.2 x 10 000 = 2 s on b: 19 s) yields to a at 10 + 8 s.
    scaled = _affinity_policy(margin=250, cache_affinity_placement=Placement.LOAD)
    candidates, decision = _second_turn(scaled, 9900, 10_000)
    assert chosen_id(candidates, decision) == "affinity-a"
    assert chosen(decision).rank_depth == 2


def test_a_prompt_that_does_not_extend_the_last_one_falls_back_to_the_scale() -> None:
    candidates, decision = _second_turn(_growth_policy(), 12_000, 10_000)
    assert chosen_id(candidates, decision) == "affinity-a"  # no known prefix: 19 s against 18 s


def test_growth_follows_the_key_to_where_it_went() -> None:
    policy = _growth_policy()
    candidates, decision = _second_turn(policy, 5000, 10_000)  # 5 s growth: yields to a
    assert chosen_id(candidates, decision) == "affinity-a"
    # The third turn on a (now the key's backend) counts its growth from the 10 000 sent there.
    third = (
        make_candidate("affinity-a", tps=1000.0, queued=2000, running=1, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
    )
    decision = policy.decide(third, make_request(input_tokens=10_300, key="k"), rng())
    assert chosen_id(third, decision) == "affinity-a"
    assert chosen(decision).prefill_tokens == 300


def test_growth_needs_a_group_of_one_and_a_known_value() -> None:
    model = {"algorithm": "wait-and-widen", "cache_affinity_prefill": "growth"}
    with pytest.raises(ConfigError, match="cache_affinity_backend_selection_count"):
        parse_lb_config({"models": {"m": {**model, "cache_affinity_backend_selection_count": 2}}})
    with pytest.raises(ConfigError, match="expected one of: scale, growth"):
        parse_lb_config({"models": {"m": {**model, "cache_affinity_prefill": "history"}}})
    definition = parse_lb_config(
        {"models": {"m": {**model, "cache_affinity_backend_selection_count": 1}}}
    ).resolve("m", None)
    assert definition.cache_affinity_prefill is PrefillEstimate.GROWTH


@settings(max_examples=100, deadline=None)
@given(
    stats=st.lists(
        st.tuples(st.integers(0, 50_000), st.integers(0, 12), st.integers(0, 8), st.integers(0, 20_000)),
        min_size=1,
        max_size=5,
    ),
    tokens=st.integers(0, 20_000),
    scale=st.sampled_from([0.0, 0.2, 1.0]),
    measured=st.sampled_from([0.0, 250.0, 4000.0]),
)
def test_the_flat_best_estimate_of_the_yield_check_is_the_load_ttft_estimate(
    stats: list[tuple[int, int, int, int]], tokens: int, scale: float, measured: float
) -> None:
    candidates = tuple(
        _measured(
            with_in_flight(
                make_candidate(f"c{i}", tps=1000.0, queued=queued, running=running, max_concurrency=limit),
                running,
                min(running, 1),
                own_tokens,
            ),
            measured * (i + 1),
        )
        for i, (queued, running, limit, own_tokens) in enumerate(stats)
    )
    rate = PrefillRate.MEASURED if measured else PrefillRate.PUBLISHED
    selector = WawSelector(waw(load_aware=True, prefill_rate=rate), Ranking.TTFT)
    request = make_request(input_tokens=tokens)
    best = selector.best_ttft(candidates, None, request, scale, None, free_slot_only=False)
    expected = min(load_ttft_ms(c, tokens, 0, scale, measured=bool(measured)) for c in candidates)
    assert best == pytest.approx(expected)


# ---- replicas learn each other's routes from Pylon --------------------------------------------------


def _route(key: str, at_s: float, tokens: int = 1000) -> AffinityRoute:
    """A route Pylon published; with ``offset_s`` 0 its wall clock is the requests' clock."""
    return AffinityRoute(key, tokens, round(at_s * 1000))


def _even() -> tuple[Candidate, ...]:
    return (
        make_candidate("affinity-a", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-b", tps=1000.0, max_concurrency=8),
        make_candidate("affinity-c", tps=1000.0, max_concurrency=8),
    )


def _request_at(key: str, now_s: float) -> Any:
    return dataclasses.replace(make_request(input_tokens=1000, key=key), received_at=now_s, now=now_s)


def _idle(key: str) -> bool:
    """No request of ``key`` in flight on this router."""
    return False


def test_a_newer_route_from_another_router_places_the_key_there() -> None:
    policy, candidates = _placing_policy(), _even()
    first = chosen_id(candidates, policy.decide(candidates, _request_at("k", 1.0), rng()))
    other = next(c.cluster_id for c in candidates if c.cluster_id != first)
    policy.learn_routes(other, [_route("k", 2.0)], 0.0, _idle)  # another replica sent k there later
    for seed in range(5):
        decision = policy.decide(candidates, _request_at("k", 3.0), rng(seed))
        assert chosen_id(candidates, decision) == other
        assert chosen(decision).rank_depth == 1


def test_another_routers_spill_of_a_key_in_flight_here_spreads_it_without_the_spill_it_moves() -> None:
    # The key has a request in flight here, so its requests run in parallel: the other replica's
    # route elsewhere (older than this router's own) is its spill, and the key now has two members.
    candidates = _even()
    for spill, expected in ((True, 2), (False, 1)):
        policy = _affinity_policy(
            margin=None, cache_affinity_placement=Placement.LOAD, cache_affinity_spill=spill
        )
        first = chosen_id(candidates, policy.decide(candidates, _request_at("k", 5.0), rng()))
        other = next(c.cluster_id for c in candidates if c.cluster_id != first)
        policy.learn_routes(other, [_route("k", 4.0)], 0.0, lambda key: key == "k")
        seen = {
            chosen_id(candidates, policy.decide(candidates, _request_at("k", 6.0), rng(seed)))
            for seed in range(16)
        }
        assert len(seen) == expected and first in seen


def test_a_route_older_than_this_routers_own_is_ignored() -> None:
    policy, candidates = _placing_policy(), _even()
    first = chosen_id(candidates, policy.decide(candidates, _request_at("k", 5.0), rng()))
    other = next(c.cluster_id for c in candidates if c.cluster_id != first)
    policy.learn_routes(other, [_route("k", 4.0)], 0.0, _idle)
    assert chosen_id(candidates, policy.decide(candidates, _request_at("k", 6.0), rng())) == first


def test_routes_convert_wall_clock_by_the_offset() -> None:
    policy, candidates = _placing_policy(), _even()
    first = chosen_id(candidates, policy.decide(candidates, _request_at("k", 5.0), rng()))
    other = next(c.cluster_id for c in candidates if c.cluster_id != first)
    # Admitted at wall 1000.5 s = monotonic 5.5 s: after this router's own route at 5.0 s.
    policy.learn_routes(other, [_route("k", 1000.5)], -995.0, _idle)
    assert chosen_id(candidates, policy.decide(candidates, _request_at("k", 6.0), rng())) == other


def test_a_learnt_route_of_an_unknown_key_places_it_and_gives_the_growth() -> None:
    policy = _affinity_policy(
        margin=250, cache_affinity_placement=Placement.LOAD, cache_affinity_prefill=PrefillEstimate.GROWTH
    )
    candidates = _even()
    policy.learn_routes("affinity-a", [_route("k", 1.0, tokens=900)], 0.0, _idle)
    decision = policy.decide(candidates, _request_at("k", 2.0), rng())
    assert chosen_id(candidates, decision) == "affinity-a"
    assert chosen(decision).prefill_tokens == 100  # only what the prompt grew by is left to prefill


def test_the_seed_ring_does_not_learn_routes() -> None:
    # Without a margin or placement by load the group is the ring's, exactly as the spec says.
    policy, candidates = _affinity_policy(margin=None), _ring(c_queued=0)
    policy.learn_routes("affinity-a", [_route("prefix-a", 1.0)], 0.0, _idle)
    decision = policy.decide(candidates, _request_at("prefix-a", 2.0), rng())
    assert chosen_id(candidates, decision) == "affinity-c"


# ---- waiting for a key's prefill in progress ---------------------------------------------------


def _prefilling(candidate: Candidate, *keys: str) -> Candidate:
    return dataclasses.replace(candidate, in_flight=InFlight(len(keys), len(keys), 1000, frozenset(keys)))


def _awaiting_policy(**settings: Any) -> Any:
    return _affinity_policy(margin=1000, cache_affinity_await_prefill=True, **settings)


def test_a_request_waits_while_its_key_is_still_prefilling_on_its_group() -> None:
    # prefix-a's group is affinity-c, where an earlier prefix-a request has not had its first byte.
    ring = _ring(c_queued=0)
    candidates = (*ring[:2], _prefilling(ring[2], "prefix-a"))
    decision = _awaiting_policy().decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert decision == Wait(10.0)
    # Another key prefilling there does not hold it, and neither does the option switched off.
    other = (*ring[:2], _prefilling(ring[2], "prefix-b"))
    decision = _awaiting_policy().decide(other, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(other, decision) == "affinity-c"
    decision = _affinity_policy(margin=1000).decide(
        candidates, make_request(input_tokens=1000, key="prefix-a"), rng()
    )
    assert chosen_id(candidates, decision) == "affinity-c"


def test_a_request_waits_too_for_its_keys_prefill_that_another_router_sent() -> None:
    # Another replica's prefix-a request is prefilling on affinity-c: only its Pylon says so.
    ring = _ring(c_queued=0)
    stats = dataclasses.replace(ring[2].stats, prefilling_cache_affinity_keys=frozenset({"prefix-a"}))
    candidates = (*ring[:2], dataclasses.replace(ring[2], stats=stats))
    decision = _awaiting_policy().decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert decision == Wait(10.0)
    request = make_request(input_tokens=1000, key="prefix-a")
    assert (
        chosen_id(candidates, _affinity_policy(margin=1000).decide(candidates, request, rng()))
        == "affinity-c"
    )


def test_the_wait_for_a_prefill_ends_at_the_routing_deadline() -> None:
    ring = _ring(c_queued=0)
    candidates = (*ring[:2], _prefilling(ring[2], "prefix-a"))
    policy = _awaiting_policy()
    request = dataclasses.replace(make_request(input_tokens=1000, key="prefix-a"), wait_deadline=0.004)
    assert policy.decide(candidates, request, rng()) == Wait(4.0)  # never past the deadline
    late = dataclasses.replace(request, now=0.004)
    assert chosen_id(candidates, policy.decide(candidates, late, rng())) == "affinity-c"


def test_a_group_that_loses_by_the_margin_still_yields_instead_of_waiting() -> None:
    ring = _ring(c_queued=3000)  # affine: 3000 + 200 ms; global best 1800 ms
    candidates = (*ring[:2], _prefilling(ring[2], "prefix-a"))
    decision = _awaiting_policy().decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(candidates, decision) in {"affinity-a", "affinity-b"}
    assert chosen(decision).rank_depth == 2


def test_await_prefill_needs_an_affinity_group() -> None:
    model = {"algorithm": "wait-and-widen", "cache_affinity_await_prefill": True}
    with pytest.raises(ConfigError, match="cache_affinity_backend_selection_count"):
        parse_lb_config({"models": {"m": model}})
    with pytest.raises(ConfigError, match="expected a boolean"):
        parse_lb_config({"models": {"m": {**model, "cache_affinity_await_prefill": "yes"}}})
    definition = parse_lb_config(
        {"models": {"m": {**model, "cache_affinity_backend_selection_count": 1}}}
    ).resolve("m", None)
    assert definition.cache_affinity_await_prefill


# ---- a key's requests spilling past its group's slots (``cache_affinity_spill``) ---------------


def _spilling_policy(**settings: Any) -> Any:
    settings.setdefault("cache_affinity_spill", True)
    return _affinity_policy(margin=None, max_queued=8, **settings)


def _full_group(*keys: str) -> tuple[Candidate, ...]:
    """prefix-a's group, affinity-c, at its 8 slots (the router's own count); ``keys`` prefill there."""
    ring = _ring(c_queued=0)
    full = dataclasses.replace(ring[2], in_flight=InFlight(8, len(keys), 0, frozenset(keys)))
    return (*ring[:2], full)


def test_a_key_spills_past_its_full_group_while_its_own_request_waits_there() -> None:
    candidates = _full_group("prefix-a")
    policy = _spilling_policy()
    decision = policy.decide(candidates, make_request(input_tokens=200, key="prefix-a"), rng())
    spilled = chosen_id(candidates, decision)
    assert spilled in {"affinity-a", "affinity-b"}
    assert chosen(decision).rank_depth == 2
    assert chosen(decision).prefill_tokens is None  # nothing cached there: the whole prompt
    # The key spreads: its group is affinity-c and the cluster it spilled to, both holding its cache.
    idle_c = (
        *(with_in_flight(c, 5, 0, 0) for c in _ring(c_queued=0)[:2]),
        with_in_flight(_ring(0)[2], 1, 0, 0),
    )
    for seed in range(5):
        decision = policy.decide(idle_c, make_request(input_tokens=200, key="prefix-a"), rng(seed))
        assert chosen_id(idle_c, decision) == "affinity-c" and chosen(decision).rank_depth == 1
    # affinity-c full, nothing of the key waiting there: the other member takes it, as a cache hit.
    full_c = (*_ring(c_queued=0)[:2], with_in_flight(_ring(0)[2], 8, 0, 0))
    for seed in range(5):
        decision = policy.decide(full_c, make_request(input_tokens=200, key="prefix-a"), rng(seed))
        assert chosen_id(full_c, decision) == spilled and chosen(decision).rank_depth == 1
        assert chosen(decision).prefill_tokens == 40  # 0.2 x 200, cached there too


def test_a_spread_key_places_a_turn_on_the_member_holding_its_newest_prompt() -> None:
    # Growth per member: affinity-c holds the key's 1000-token prompt, the member it spilled to
    # the 1100-token one; the next turn (1200 tokens) has 200 left on c and 100 there.
    policy = _spilling_policy(cache_affinity_prefill=PrefillEstimate.GROWTH, cache_affinity_wait_ms=2000)
    first = policy.decide(_ring(0), make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(_ring(0), first) == "affinity-c"
    # Prefilling the cached 1000 tokens again takes 1 s, within X: the 1100-token request spills.
    full = _full_group("prefix-a")
    spilled = chosen_id(full, policy.decide(full, make_request(input_tokens=1100, key="prefix-a"), rng()))
    assert spilled in {"affinity-a", "affinity-b"}
    equal = tuple(with_in_flight(c, 2, 0, 0) for c in _ring(c_queued=0))
    decision = policy.decide(equal, make_request(input_tokens=1200, key="prefix-a"), rng())
    assert chosen_id(equal, decision) == spilled
    assert chosen(decision).prefill_tokens == 100


@pytest.mark.parametrize(
    ("candidates", "settings"),
    [
        (_full_group("prefix-b"), {}),  # a turn of a conversation: nothing of its key waits there
        (_full_group("prefix-a"), {"cache_affinity_spill": False}),
        # A free slot in the group: the request starts there at once.
        ((*_ring(c_queued=0)[:2], _prefilling(_ring(c_queued=0)[2], "prefix-a")), {}),
    ],
    ids=["other-key-waits", "option-off", "group-has-a-slot"],
)
def test_a_key_stays_with_its_group(candidates: tuple[Candidate, ...], settings: dict[str, Any]) -> None:
    decision = _spilling_policy(**settings).decide(
        candidates, make_request(input_tokens=200, key="prefix-a"), rng()
    )
    assert chosen_id(candidates, decision) == "affinity-c"
    assert chosen(decision).rank_depth == 1


def test_a_key_holds_its_group_when_prefilling_its_cache_again_takes_longer_than_x() -> None:
    # 1000 tokens at 1000 tok/s, 80 % cached: 800 ms to prefill again elsewhere, X is 200 ms.
    candidates = _full_group("prefix-a")
    decision = _spilling_policy().decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(candidates, decision) == "affinity-c"
    # With nothing cached (scale 1.0) a move repeats nothing.
    policy = _spilling_policy(cache_affinity_input_tokens_scale=1.0)
    decision = policy.decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    assert chosen_id(candidates, decision) in {"affinity-a", "affinity-b"}


def test_a_key_spills_when_the_wait_for_a_slot_is_longer_than_prefilling_its_cache_again() -> None:
    # 800 ms to prefill again elsewhere (above); one of the 8 slots frees every slot time / 8.
    full = _full_group("prefix-a")
    request = make_request(input_tokens=1000, key="prefix-a")

    def decide(slot_s: float, running: int) -> str:
        group = dataclasses.replace(
            full[2], measured_slot_s=slot_s, in_flight=InFlight(running, 1, 0, frozenset({"prefix-a"}))
        )
        candidates = (*full[:2], group)
        return chosen_id(candidates, _spilling_policy().decide(candidates, request, rng()))

    assert decide(4.0, 8) == "affinity-c"  # first in line: 500 ms
    assert decide(8.0, 8) in {"affinity-a", "affinity-b"}  # 1 000 ms
    assert decide(2.0, 12) in {"affinity-a", "affinity-b"}  # five in line: 1 250 ms
    assert decide(0.0, 12) == "affinity-c"  # not measured yet: X alone


@pytest.mark.parametrize(
    ("own", "mine", "slot_s", "expected"),
    [
        (5, 8, 1.0, "spills"),  # most of the 8: 800 ms again elsewhere within a 1 s slot time
        (5, 8, 0.5, "holds"),  # a slot time shorter than prefilling the cache again
        (4, 8, 1.0, "holds"),  # half: the other keys fill it too, and nothing of prefix-a waits there
        (8, 8, 0.0, "holds"),  # no slot time known yet: X alone (200 ms)
        (8, 8, None, "spills"),  # none ended yet, the oldest has held its slot for 1 s
        (4, 4, 1.0, "spills"),  # another router's requests hold the other 4 slots: its share
        (1, 1, 1.0, "holds"),  # one request is not a key running in parallel
    ],
)
def test_a_key_that_fills_its_group_spreads_without_a_request_waiting_there(
    own: int, mine: int, slot_s: float | None, expected: str
) -> None:
    # 1000 tokens at 1000 tok/s, 80 % cached: 800 ms to prefill again elsewhere. affinity-c runs 8
    # (published), ``mine`` of them this router's, ``own`` of those prefix-a's; all decode, so the
    # even-rate wait for a slot (slot time / 8) is not what decides.
    ring = _ring(c_queued=0)
    keys = MappingProxyType({"prefix-a": own, "prefix-b": mine - own})
    full = dataclasses.replace(ring[2], stats=dataclasses.replace(ring[2].stats, num_running_queries=8))
    in_flight = InFlight(mine, 0, 0, keys=keys)
    if slot_s is None:  # the request is decided at time 0
        group = dataclasses.replace(full, slot_held_since=-1.0, in_flight=in_flight)
    else:
        group = dataclasses.replace(full, measured_slot_s=slot_s, in_flight=in_flight)
    candidates = (*ring[:2], group)
    decision = _spilling_policy().decide(candidates, make_request(input_tokens=1000, key="prefix-a"), rng())
    if expected == "spills":
        assert chosen_id(candidates, decision) in {"affinity-a", "affinity-b"}
        assert chosen(decision).rank_depth == 2
    else:
        assert chosen_id(candidates, decision) == "affinity-c"


def test_slot_wait_is_one_slot_time_per_request_in_line() -> None:
    assert slot_wait_ms(1.6, 7, 8) == 0.0  # a free slot
    assert slot_wait_ms(1.6, 8, 8) == pytest.approx(200.0)
    assert slot_wait_ms(1.6, 11, 8) == pytest.approx(800.0)
    assert slot_wait_ms(1.6, 11, 0) == 0.0  # no known limit


def test_slot_hold_is_the_measure_or_until_one_exists_the_oldest_running_requests_age() -> None:
    candidate = _ring(c_queued=0)[0]
    assert slot_hold_s(candidate, 10.0) == 0.0  # nothing known
    running = dataclasses.replace(candidate, slot_held_since=7.5)
    assert slot_hold_s(running, 10.0) == 2.5  # a lower bound that grows while it runs
    assert slot_hold_s(running, 11.0) == 3.5
    assert slot_hold_s(dataclasses.replace(running, measured_slot_s=1.2), 10.0) == 1.2


@pytest.mark.parametrize(
    ("slot_s", "held_since", "expected"),
    [(4.0, math.inf, "b"), (0.0, math.inf, "a"), (0.0, -4.0, "b"), (0.0, -2.0, "a")],
)
def test_a_full_backend_that_max_queued_allows_is_ranked_with_the_wait_for_a_slot(
    slot_s: float, held_since: float, expected: str
) -> None:
    # a: all 8 slots taken, no prompt work waiting; one of 8 slots frees every 4 s / 8 = 500 ms.
    # b: a free slot behind 300 ms of prompt work. With nothing known of a slot's time, a looks
    # free; before one has ended, the oldest request's 4 s (2 s) there bound it.
    full = dataclasses.replace(
        make_candidate("a", tps=1000.0, running=8, max_concurrency=8),
        measured_slot_s=slot_s,
        slot_held_since=held_since,
    )
    candidates = (full, make_candidate("b", tps=1000.0, queued=300, running=2, max_concurrency=8))
    policy = build_policy(waw(load_aware=True, max_queued=8))
    for seed in range(5):
        decision = policy.decide(candidates, make_request(input_tokens=100), rng(seed))
        assert chosen_id(candidates, decision) == expected


def test_a_key_holds_its_group_when_no_other_cluster_has_a_free_slot() -> None:
    ring = _full_group("prefix-a")
    busy = tuple(with_in_flight(candidate, 8, 0, 0) for candidate in ring[:2])
    candidates = (*busy, ring[2])
    decision = _spilling_policy().decide(candidates, make_request(input_tokens=200, key="prefix-a"), rng())
    assert chosen_id(candidates, decision) == "affinity-c"


def test_spill_needs_an_affinity_group() -> None:
    model = {"algorithm": "wait-and-widen", "cache_affinity_spill": True}
    with pytest.raises(ConfigError, match="cache_affinity_backend_selection_count"):
        parse_lb_config({"models": {"m": model}})
    definition = parse_lb_config(
        {"models": {"m": {**model, "cache_affinity_backend_selection_count": 1}}}
    ).resolve("m", None)
    assert definition.cache_affinity_spill


# ---- the measured prefill rate (``prefill_rate: measured``) --------------------------------------------


def _measured(candidate: Candidate, tps: float) -> Candidate:
    return dataclasses.replace(candidate, measured_input_tps=tps)


def _pinned_low() -> tuple[Candidate, Candidate]:
    """Both publish 100 tok/s. "a" has 2000 tokens prefilling and measures 10 000 tok/s (0.2 s of
    work); "b" has 500 and measures 1000 tok/s (0.5 s)."""
    a = _measured(with_in_flight(make_candidate("a", tps=100.0, max_concurrency=8), 2, 2, 2000), 10_000.0)
    b = _measured(with_in_flight(make_candidate("b", tps=100.0, max_concurrency=8), 1, 1, 500), 1000.0)
    return a, b


def test_a_measured_rate_above_the_published_one_divides_the_load_aware_estimates() -> None:
    a, _ = _pinned_low()
    assert load_queue_ms(a, 0) == 20_000.0  # published: 2000 tokens at 100 tok/s
    assert load_queue_ms(a, 0, measured=True) == 200.0
    assert load_ttft_ms(a, 1000, 0, 0.5, measured=True) == pytest.approx(1.0 + 200.0 + 50.0)
    unmeasured = _measured(a, 0.0)
    assert load_queue_ms(unmeasured, 0, measured=True) == 20_000.0  # none yet: the published mean
    # Below the published mean the measure is not used: both read low, the larger is the closer.
    assert load_queue_ms(_measured(a, 50.0), 0, measured=True) == 20_000.0
    assert load_ttft_score(a, 0, 1000) == load_ttft_ms(a, 1000, 0)


@pytest.mark.parametrize("algorithm", ["power-of-n", "wait-and-widen"])
def test_a_measured_rate_ranks_the_work_in_progress_at_the_engines_real_speed(algorithm: str) -> None:
    candidates = _pinned_low()
    fields = {"algorithm": algorithm, "load_aware": True, "n": 2, "sample_count": 2}
    if algorithm == "power-of-n":
        del fields["n"]
    else:
        del fields["sample_count"]
    published = build_policy(parse_lb_config({"models": {"m": fields}}).resolve("m", None))
    measured = build_policy(
        parse_lb_config({"models": {"m": {**fields, "prefill_rate": "measured"}}}).resolve("m", None)
    )
    request = make_request(input_tokens=100)
    for seed in range(20):
        assert chosen_id(candidates, published.decide(candidates, request, rng(seed))) == "b"
        assert chosen_id(candidates, measured.decide(candidates, request, rng(seed))) == "a"


def test_the_measured_rate_leaves_admission_and_the_free_slot_rule_alone() -> None:
    full = _measured(make_candidate("a", tps=100.0, queued=1000, running=8, max_concurrency=8), 10_000.0)
    assert effective_queue_ms(full.stats, 0) == 10_000  # the header Pylon checks: its own rate


def test_prefill_rate_needs_load_aware_and_a_known_value() -> None:
    with pytest.raises(ConfigError, match="set load_aware to true"):
        parse_lb_config({"models": {"m": {"algorithm": "wait-and-widen", "prefill_rate": "measured"}}})
    with pytest.raises(ConfigError, match="expected one of: published, measured"):
        parse_lb_config({"models": {"m": {"algorithm": "power-of-n", "load_aware": True, "prefill_rate": 1}}})
    with pytest.raises(ConfigError, match="does not support"):
        parse_lb_config({"models": {"m": {"algorithm": "pulsar", "prefill_rate": "measured"}}})
    definition = parse_lb_config(
        {"models": {"m": {"algorithm": "power-of-n", "load_aware": True, "prefill_rate": "measured"}}}
    ).resolve("m", None)
    assert definition.prefill_rate is PrefillRate.MEASURED


def test_at_the_slot_limit_the_spec_estimate_is_converted_to_the_measured_rate() -> None:
    """Pylon's priority map is its queued work timed at its published rate (100 tok/s here)."""
    full = make_candidate("a", tps=100.0, queued=1000, running=8, max_concurrency=8, queue_map={0: 10_000})
    assert load_queue_ms(full, 0) == 10_000.0
    assert load_queue_ms(_measured(full, 10_000.0), 0, measured=True) == 100.0
    assert load_queue_ms(_measured(full, 0.0), 0, measured=True) == 10_000.0


# ---- prefill sharing (lb-config ``prefill_sharing``) --------------------------------------------------


def prefilling(candidate: Candidate, *sizes: int) -> Candidate:
    """``candidate`` with this router's prompts of ``sizes`` tokens prefilling there."""
    in_flight = InFlight(len(sizes), len(sizes), sum(sizes), prefill_sizes=tuple(sorted(sizes)))
    return dataclasses.replace(candidate, in_flight=in_flight)


def test_a_shared_prefill_waits_for_each_prompt_up_to_its_own_size() -> None:
    idle = make_candidate("a", tps=1000.0, max_concurrency=8)
    three = prefilling(idle, 500, 2000, 4000)
    assert shared_prefill_tokens(three, 1000.0) == 500 + 1000 + 1000
    assert shared_prefill_tokens(three, 5000.0) == 500 + 2000 + 4000  # all of it
    assert shared_prefill_tokens(three, 0.0) == 0.0
    assert shared_prefill_tokens(idle, 1000.0) == 0.0
    # Prompts the stats publish beyond this router's: their published total, each at most the
    # request's size. Here 3 more with 6000 tokens in all.
    stats = dataclasses.replace(idle.stats, queue_size=4, queued_input_size=6500)
    published = prefilling(dataclasses.replace(idle, stats=stats), 500)
    assert shared_prefill_tokens(published, 1000.0) == 500 + 3 * 1000
    assert shared_prefill_tokens(published, 3000.0) == 500 + 6000


def test_the_sharing_queue_is_both_waits_and_at_the_limit_the_wait_for_a_slot() -> None:
    free = prefilling(make_candidate("a", tps=1000.0, max_concurrency=8), 500, 4000)
    # 500 + 1000 tokens shared, twice (its wait and theirs), at 1000 tokens/s.
    assert sharing_queue_ms(free, 1000.0, 1000.0, 2, now=10.0) == 3000.0
    full = dataclasses.replace(free, measured_slot_s=4.0)
    # 8 slots held 4 s each free one every 500 ms; two requests queue ahead of this one.
    assert sharing_queue_ms(full, 1000.0, 1000.0, 10, now=10.0) == 3000.0 + 3 * 500.0
    assert sharing_queue_ms(free, 1000.0, 0.0, 2, now=10.0) == math.inf


def _one_long_and_four_short() -> tuple[Candidate, ...]:
    # "long": one 8000-token prompt prefilling; "short": four of 1500 tokens (6000 in all).
    long = prefilling(make_candidate("long", tps=1000.0, max_concurrency=8), 8000)
    short = prefilling(make_candidate("short", tps=1000.0, max_concurrency=8), 1500, 1500, 1500, 1500)
    return long, short


def _picks_without_and_with_sharing(
    candidates: tuple[Candidate, ...], input_tokens: int
) -> set[tuple[str, str]]:
    """The cluster load-aware wait-and-widen picks, first without ``prefill_sharing``, then with
    it, over ten seeds (a set: one pair when every seed agrees)."""
    request = make_request(input_tokens=input_tokens)
    own = build_policy(waw(n=2, load_aware=True))
    shared = build_policy(waw(n=2, load_aware=True, prefill_sharing=True))
    return {
        (
            chosen_id(candidates, own.decide(candidates, request, rng(seed))),
            chosen_id(candidates, shared.decide(candidates, request, rng(seed))),
        )
        for seed in range(10)
    }


def test_with_prefill_sharing_a_prompt_goes_where_sharing_costs_least() -> None:
    # First come, first served: 8000 + 3000 ms of work against 6000 + 3000. Shared: beside the
    # long prompt it ends after 3000 + 3000 ms and delays it 3000 ms (9000 in all); beside the four
    # short ones after 6000 + 3000 ms, each of them 1500 ms later (15 000 in all).
    assert _picks_without_and_with_sharing(_one_long_and_four_short(), 3000) == {("short", "long")}


def test_the_yield_check_compares_the_same_costs_with_prefill_sharing() -> None:
    candidates = _one_long_and_four_short()
    selector = WawSelector(waw(load_aware=True, prefill_sharing=True), Ranking.TTFT)
    request = make_request(input_tokens=3000)
    best = selector.best_ttft(candidates, None, request, 1.0, None, free_slot_only=False)
    assert best == pytest.approx(1.0 + 3000.0 + 3000.0 + 3000.0)  # rtt + shared twice + own
    # A cache discount shrinks the prompt that shares the engine, not only its own prefill.
    cached = selector.best_ttft(candidates, None, request, 0.2, None, free_slot_only=False)
    assert cached == pytest.approx(1.0 + 600.0 + 600.0 + 600.0)


def test_with_prefill_sharing_a_request_without_a_token_count_goes_to_the_fewest_running() -> None:
    # "prefilling": one 8000-token prompt and nothing else; "decoding": four answers, no prompt.
    # First come, first served the request waits for the 8000 ms of work ahead; shared, an empty
    # prompt waits for nothing, and the tie goes to fewer requests running.
    prefilling_one = prefilling(make_candidate("prefilling", tps=1000.0, max_concurrency=8), 8000)
    decoding = make_candidate("decoding", tps=1000.0, max_concurrency=8, running=4)
    assert _picks_without_and_with_sharing((prefilling_one, decoding), 0) == {("decoding", "prefilling")}


def test_prefill_sharing_needs_the_load_aware_estimates() -> None:
    with pytest.raises(ConfigError, match="prefill_sharing"):
        parse_lb_config({"models": {"m": {"algorithm": "wait-and-widen", "prefill_sharing": True}}})
