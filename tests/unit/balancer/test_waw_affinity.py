"""Affinity groups and the two-phase decision. Ring memberships come from Appendix A: with seed
``seed-1``, routing key ``rk-1``, model ``model-a`` and 8 virtual nodes over affinity-a/b/c, key
``prefix-a`` selects [c] (count 1) or [c, a] (count 2) and key ``prefix-b`` selects [b] or [b, c]."""

from __future__ import annotations

import random
from typing import Any

import pytest
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng, waw

from stargate.balancer import (
    Candidate,
    Comparator,
    Selected,
    Unavailable,
    Wait,
    build_policy,
    effective_queue_ms,
)
from stargate.balancer.settings import Policy
from stargate.balancer.types import Choice
from stargate.balancer.wait_and_widen import Ranking, WawSelector

FULL: dict[str, Any] = {"running": 1, "max_concurrency": 1}
FREE: dict[str, Any] = {"running": 0, "max_concurrency": 1}


def _policy(count: int = 1, wait_ms: int = 0, **settings: Any) -> Policy:
    return build_policy(
        waw(selection_count=count, virtual_nodes=8, seed="seed-1", cache_affinity_wait_ms=wait_ms, **settings)
    )


def _clusters(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> tuple[Candidate, ...]:
    return (
        make_candidate("affinity-a", **a),
        make_candidate("affinity-b", **b),
        make_candidate("affinity-c", **c),
    )


def test_b54_same_key_same_cluster() -> None:
    candidates = _clusters({"rtt_ms": 1.0}, {"rtt_ms": 1.0}, {"rtt_ms": 30.0})
    policy, random_source = _policy(), random.Random(54)
    for _ in range(30):
        decision = policy.decide(candidates, make_request(key="prefix-a"), random_source)
        assert chosen_id(candidates, decision) == "affinity-c"
        assert chosen(decision).rank_depth == 1


def test_b56_b141_full_primary_with_x0_goes_global_at_once() -> None:
    candidates = _clusters({"rtt_ms": 5.0, **FREE}, {"rtt_ms": 5.0, **FREE}, {"rtt_ms": 1.0, **FULL})
    decision = _policy().decide(candidates, make_request(key="prefix-a"), rng())
    assert chosen_id(candidates, decision) in {"affinity-a", "affinity-b"}
    assert chosen(decision).rank_depth == 2


def test_b57_second_member_when_first_is_full() -> None:
    candidates = _clusters({"rtt_ms": 1.0, **FREE}, {"rtt_ms": 1.0, **FREE}, {"rtt_ms": 1.0, **FULL})
    policy, random_source = _policy(count=2, wait_ms=200), random.Random(57)
    for _ in range(20):
        decision = policy.decide(candidates, make_request(key="prefix-a"), random_source)
        assert chosen_id(candidates, decision) == "affinity-a"
        assert chosen(decision).rank_depth == 1


def test_b58_b147_excluded_primary_does_not_promote_successor() -> None:
    # Count 2 would add affinity-a after affinity-c; with count 1 it stays a public candidate.
    candidates = _clusters({"rtt_ms": 2.0}, {"rtt_ms": 1.0}, {"rtt_ms": 1.0})
    policy = _policy(count=1, wait_ms=200)
    before = policy.decide(candidates, make_request(key="prefix-a", excluded={"affinity-c"}), rng())
    assert isinstance(before, Wait) and before.ms == pytest.approx(200.0)
    random_source = random.Random(58)
    for _ in range(20):
        after = policy.decide(
            candidates, make_request(key="prefix-a", excluded={"affinity-c"}, elapsed_ms=200.0), random_source
        )
        assert chosen(after).rank_depth == 2
        assert chosen_id(candidates, after) in {"affinity-a", "affinity-b"}
    slow_successor = _clusters({"rtt_ms": 60.0}, {"rtt_ms": 1.0}, {"rtt_ms": 1.0})
    after = policy.decide(
        slow_successor, make_request(key="prefix-a", excluded={"affinity-c"}, elapsed_ms=200.0), rng()
    )
    assert chosen_id(slow_successor, after) == "affinity-b"


def test_b61_keys_spread_over_primaries() -> None:
    candidates = _clusters({}, {}, {})
    policy = _policy()
    primaries = {
        chosen_id(candidates, policy.decide(candidates, make_request(key=f"key-{i}"), rng()))
        for i in range(128)
    }
    assert len(primaries) >= 2


def test_b62_candidate_change_invalidates_cached_group() -> None:
    policy = _policy(count=1)
    candidates = _clusters({}, {}, {})
    assert chosen(policy.decide(candidates, make_request(key="prefix-a"), rng())).index == 2
    replacement = (make_candidate("new-cluster"),)
    decision = policy.decide(replacement, make_request(key="prefix-a"), rng())
    assert decision == Selected(Choice(0, rank_depth=1))


def test_b52_num_requests_queued_in_affinity_path() -> None:
    candidates = (
        make_candidate("busy", rtt_ms=5.0, queue_size=10),
        make_candidate("quiet", rtt_ms=50.0, queue_size=1),
    )
    policy = _policy(count=2, wait_ms=500, comparator=Comparator.NUM_REQUESTS_QUEUED, ttft_bucket_size_ms=100)
    random_source = random.Random(52)
    for _ in range(30):
        decision = policy.decide(candidates, make_request(key="any-key"), random_source)
        assert chosen_id(candidates, decision) == "quiet" and chosen(decision).rank_depth == 1


def test_b139_global_closed_until_x() -> None:
    # Group {affinity-b} is full; affinity-a and affinity-c are idle in the same TTFT bucket.
    candidates = _clusters({"rtt_ms": 1.0, **FREE}, {"rtt_ms": 1.0, **FULL}, {"rtt_ms": 1.0, **FREE})
    policy = _policy(count=1, wait_ms=200)
    for elapsed in (0.0, 50.0, 199.0):
        decision = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=elapsed), rng())
        assert decision == Wait(pytest.approx(200.0 - elapsed))
    decision = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=200.0), rng())
    assert chosen_id(candidates, decision) in {"affinity-a", "affinity-c"}
    assert chosen(decision).rank_depth == 2


def test_b140_available_affine_cluster_at_once() -> None:
    candidates = _clusters({"rtt_ms": 1.0}, {"rtt_ms": 50.0, **FREE}, {"rtt_ms": 1.0})
    decision = _policy(count=1, wait_ms=200).decide(candidates, make_request(key="prefix-b"), rng())
    assert decision == Selected(Choice(1, rank_depth=1))


def test_b142_b143_waits_without_deadline_headers_until_x() -> None:
    # The policy keeps answering Wait (never Unavailable) before X; an explicit max-wait shorter
    # than X therefore ends in the proxy before any global candidate is offered.
    candidates = _clusters({"rtt_ms": 1.0}, {"rtt_ms": 1.0, **FULL}, {"rtt_ms": 1.0})
    policy = _policy(count=1, wait_ms=200)
    elapsed = 0.0
    while True:
        decision = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=elapsed), rng())
        if isinstance(decision, Selected):
            break
        assert isinstance(decision, Wait) and 0.0 < decision.ms <= 200.0 - elapsed
        elapsed += min(decision.ms, 25.0)
    assert elapsed == pytest.approx(200.0)
    assert chosen(decision).rank_depth == 2


def test_b144_global_buckets_widen_from_x() -> None:
    candidates = _clusters({"rtt_ms": 1.0, **FULL}, {"rtt_ms": 1.0, **FULL}, {"rtt_ms": 81.0, **FREE})
    policy = _policy(count=1, wait_ms=200)
    at_x = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=200.0), rng())
    assert isinstance(at_x, Wait) and at_x.ms == pytest.approx(20.0)
    later = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=219.0), rng())
    assert isinstance(later, Wait) and later.ms == pytest.approx(1.0)
    opened = policy.decide(candidates, make_request(key="prefix-b", elapsed_ms=220.0), rng())
    assert chosen_id(candidates, opened) == "affinity-c" and chosen(opened).rank_depth == 2


def test_b145_affinity_phase_scales_prefill_global_phase_does_not() -> None:
    # Group [affinity-c, affinity-a]: c is instant but full, a prefills 100 000 tokens at 10 000
    # tps (10 s full, 1 s at scale 0.1); b is outside the group with a 1 s full prefill.
    tokens = 100_000
    candidates = _clusters(
        {"rtt_ms": 0.0, "tps": 10_000.0},
        {"rtt_ms": 0.0, "tps": 100_000.0},
        {"rtt_ms": 0.0, "tps": 1e15, **FULL},
    )
    policy = _policy(count=2, wait_ms=5000, cache_affinity_input_tokens_scale=0.1)
    waiting = policy.decide(candidates, make_request(key="prefix-a", input_tokens=tokens), rng())
    assert isinstance(waiting, Wait) and waiting.ms == pytest.approx(250.0)  # (1000 - 0) * 0.25
    selected = policy.decide(
        candidates, make_request(key="prefix-a", input_tokens=tokens, elapsed_ms=250.0), rng()
    )
    assert chosen_id(candidates, selected) == "affinity-a" and chosen(selected).rank_depth == 1

    selector = WawSelector(waw(), Ranking.TTFT)
    request = make_request(key="prefix-a", input_tokens=tokens)
    # Global phase (full prefill): b opens after (1000 - 0) * 0.25, a only after a further 2250 ms.
    assert selector.phase(candidates, None, request, 1.0, 0.0, None, rng()) == pytest.approx(250.0)
    assert selector.phase(candidates, None, request, 1.0, 250.0, None, rng()) == Choice(1)
    only_a = (candidates[0], candidates[2])
    assert selector.phase(only_a, None, request, 1.0, 0.0, None, rng()) == pytest.approx(2500.0)
    assert selector.phase(only_a, None, request, 0.1, 0.0, None, rng()) == pytest.approx(250.0)
    # The expected-queue value is never scaled.
    assert effective_queue_ms(candidates[0].stats, 0) == 0


@pytest.mark.parametrize(
    "flags",
    [
        {"ignore_queue_time": True},
        {"ignore_input_processing_time": True},
        {"ignore_queue_time": True, "ignore_input_processing_time": True},
    ],
)
def test_b146_final_ranking_keeps_scaled_prefill_and_queue(flags: dict[str, bool]) -> None:
    scaled = (make_candidate("a", rtt_ms=5.0, tps=1000.0), make_candidate("b", rtt_ms=50.0, tps=100_000.0))
    policy = _policy(
        count=2, wait_ms=500, ttft_bucket_size_ms=100, cache_affinity_input_tokens_scale=0.01, **flags
    )
    random_source = random.Random(146)
    for _ in range(30):
        # a: 5 + 10 (scaled) = 15 beats b: 50 + 0.1; with unscaled prefill b would win (1005 vs 60).
        decision = policy.decide(scaled, make_request(key="k", input_tokens=1000), random_source)
        assert chosen_id(scaled, decision) == "a"
    queued = (make_candidate("a", rtt_ms=5.0, queue_map={0: 100}), make_candidate("b", rtt_ms=10.0))
    policy = _policy(
        count=2, wait_ms=500, ttft_bucket_size_ms=200, cache_affinity_input_tokens_scale=0.5, **flags
    )
    for _ in range(30):
        assert chosen_id(queued, policy.decide(queued, make_request(key="k"), random_source)) == "b"


def test_b148_everything_excluded_ends_at_once() -> None:
    candidates = _clusters({}, {}, {})
    excluded = {"affinity-a", "affinity-b", "affinity-c"}
    decision = _policy(count=1, wait_ms=200).decide(
        candidates, make_request(key="prefix-b", excluded=excluded), rng()
    )
    assert isinstance(decision, Unavailable)
    assert isinstance(_policy().decide((), make_request(key="prefix-b"), rng()), Unavailable)


def test_b149_earliest_wake_up_wins_before_and_after_x() -> None:
    # Group [affinity-c (instant, full), affinity-a]; affinity-b is public.
    near = _clusters({"rtt_ms": 40.0}, {"rtt_ms": 1000.0}, {"rtt_ms": 0.0, **FULL})
    waiting = _policy(count=2, wait_ms=150).decide(near, make_request(key="prefix-a"), rng())
    assert isinstance(waiting, Wait) and waiting.ms == pytest.approx(10.0)
    far = _clusters({"rtt_ms": 800.0}, {"rtt_ms": 1000.0}, {"rtt_ms": 0.0, **FULL})
    policy = _policy(count=2, wait_ms=150)
    before_x = policy.decide(far, make_request(key="prefix-a"), rng())
    assert isinstance(before_x, Wait) and before_x.ms == pytest.approx(150.0)
    after_x = policy.decide(far, make_request(key="prefix-a", elapsed_ms=160.0), rng())
    assert isinstance(after_x, Wait) and after_x.ms == pytest.approx(
        40.0
    )  # affine 200 - 160 < global 250 - 10


def test_affinity_group_cache_is_bounded() -> None:
    policy = _policy(count=1)
    candidates = _clusters({}, {}, {})
    for i in range(5000):
        policy.decide(candidates, make_request(key=f"key-{i}"), rng())
    policy.decide(candidates, make_request(key="x" * 300), rng())
    groups = policy._groups  # type: ignore[attr-defined]
    assert len(groups._cache) <= 4096
    assert groups._cache.get("x" * 300) is None


def test_replicas_agree_on_every_keys_affinity_group() -> None:
    """Two Stargate replicas load the same lb-config and see the same clusters (in different orders):
    every key gets the same affinity cluster on both, with no coordination between them."""
    clusters = tuple(make_candidate(f"cluster-{i}", rtt_ms=1.0) for i in range(7))
    shuffled = tuple(reversed(clusters))
    one, two = _policy(count=1), _policy(count=1)
    chosen_clusters = set()
    for n in range(200):
        request = make_request(key=f"session-{n}")
        first = chosen_id(clusters, one.decide(clusters, request, random.Random(n)))
        assert chosen_id(shuffled, two.decide(shuffled, request, random.Random(n + 1))) == first
        chosen_clusters.add(first)
    assert len(chosen_clusters) == len(clusters)  # and the keys spread over every cluster
