from __future__ import annotations

import random

import pytest
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng, waw

from stargate.balancer import Candidate, Comparator, Unavailable, Wait, build_policy
from stargate.balancer.estimates import has_capacity
from stargate.balancer.wait_and_widen import Ranking, WawSelector
from stargate.errors import ConfigError


def _picks(policy: object, candidates: tuple[Candidate, ...], times: int = 40, **request: object) -> set[str]:
    random_source = random.Random(99)
    return {
        chosen_id(candidates, policy.decide(candidates, make_request(**request), random_source))  # type: ignore[attr-defined]
        for _ in range(times)
    }


def test_b37_lower_rtt_wins() -> None:
    candidates = (make_candidate("far", rtt_ms=50.0), make_candidate("near", rtt_ms=5.0))
    assert _picks(build_policy(waw()), candidates, input_tokens=10) == {"near"}


def test_b38_slow_bucket_locked_at_arrival() -> None:
    candidates = tuple(make_candidate(f"rtt{r}", rtt_ms=float(r), tps=10.0) for r in (5, 20, 50))
    policy = build_policy(waw())
    assert "rtt50" not in _picks(policy, candidates, times=200, input_tokens=1)
    full = (
        tuple(
            make_candidate(c.cluster_id, rtt_ms=c.rtt_s * 1000, tps=10.0, running=1, max_concurrency=1)
            for c in candidates[:2]
        )
        + candidates[2:]
    )
    decision = policy.decide(full, make_request(input_tokens=1), rng())
    assert isinstance(decision, Wait) and decision.ms == pytest.approx(11.25)
    assert (
        chosen_id(full, policy.decide(full, make_request(input_tokens=1, elapsed_ms=11.25), rng())) == "rtt50"
    )


def test_b39_worked_unlock_example() -> None:
    candidates = (
        make_candidate("fast-full", rtt_ms=20.0, running=1, max_concurrency=1),
        make_candidate("slower-available", rtt_ms=60.0, running=0, max_concurrency=1),
    )
    policy = build_policy(waw(n=1))
    assert (
        chosen_id(candidates, policy.decide(candidates, make_request(elapsed_ms=20.0), rng()))
        == "slower-available"
    )
    at_arrival = policy.decide(candidates, make_request(elapsed_ms=0.0), rng())
    assert isinstance(at_arrival, Wait) and at_arrival.ms == pytest.approx(10.0)
    assert isinstance(policy.decide(candidates, make_request(elapsed_ms=9.9), rng()), Wait)


def test_b40_available_neighbour_in_same_bucket() -> None:
    candidates = (
        make_candidate("full", rtt_ms=10.0, running=1, max_concurrency=1),
        make_candidate("available", rtt_ms=11.0, running=0, max_concurrency=1),
    )
    assert _picks(build_policy(waw()), candidates) == {"available"}


def test_b41_capacity_allows_max_queued_overflow() -> None:
    assert has_capacity(make_candidate("c", running=5, max_concurrency=4).stats, 2)
    assert not has_capacity(make_candidate("c", running=6, max_concurrency=4).stats, 2)
    assert has_capacity(make_candidate("c", running=10_000, max_concurrency=0).stats, 0)
    candidates = (make_candidate("c", running=5, max_concurrency=4),)
    assert _picks(build_policy(waw(max_queued=2)), candidates, times=1) == {"c"}
    assert isinstance(build_policy(waw(max_queued=1)).decide(candidates, make_request(), rng()), Unavailable)


def test_b42_queue_slo_filters_before_bucketing() -> None:
    candidates = (
        make_candidate("over-slo-fast", rtt_ms=1.0, queue_map={0: 10}),
        make_candidate("admissible-slow", rtt_ms=100.0, queue_map={0: 0}),
    )
    assert _picks(build_policy(waw(queue_slo_ms=(5, 5))), candidates) == {"admissible-slow"}
    # Without the SLO the fast one is in the first bucket and the slow one is locked.
    assert _picks(build_policy(waw()), candidates) == {"over-slo-fast"}


def test_b43_single_over_slo_candidate() -> None:
    decision = build_policy(waw(queue_slo_ms=(5, 5))).decide(
        (make_candidate("c", queue_map={0: 10}),), make_request(), rng()
    )
    assert isinstance(decision, Unavailable)


def test_b44_queue_slo_interpolates_over_request_slo() -> None:
    selector = WawSelector(waw(queue_slo_ms=(100, 300)), Ranking.TTFT)
    assert selector.queue_limit_ms(make_request(elapsed_ms=500.0, slo_ms=1000)) == pytest.approx(200.0)
    assert selector.queue_limit_ms(make_request(elapsed_ms=500.0)) == 300.0
    assert selector.queue_limit_ms(make_request(elapsed_ms=500.0, slo_ms=0)) == 300.0
    assert selector.queue_limit_ms(make_request(elapsed_ms=5000.0, slo_ms=1000)) == 300.0
    assert WawSelector(waw(), Ranking.TTFT).queue_limit_ms(make_request()) is None
    policy = build_policy(waw(queue_slo_ms=(100, 300)))
    candidate = (make_candidate("c", queue_map={0: 250}),)
    assert isinstance(
        policy.decide(candidate, make_request(elapsed_ms=500.0, slo_ms=1000), rng()), Unavailable
    )
    assert chosen(policy.decide(candidate, make_request(elapsed_ms=500.0), rng())).index == 0


def test_b45_ignore_queue_time_buckets_by_rtt() -> None:
    candidates = (
        make_candidate("rtt5-queued", rtt_ms=5.0, queue_map={0: 1000}),
        make_candidate("rtt50-idle", rtt_ms=50.0, queue_map={0: 0}),
    )
    assert _picks(build_policy(waw(ignore_queue_time=True)), candidates) == {"rtt5-queued"}
    assert _picks(build_policy(waw()), candidates) == {"rtt50-idle"}


def test_b46_ignore_input_processing_time() -> None:
    candidates = (
        make_candidate("rtt1-slow", rtt_ms=1.0, tps=10.0),
        make_candidate("rtt50-fast", rtt_ms=50.0, tps=200.0),
    )
    assert _picks(build_policy(waw(ignore_input_processing_time=True)), candidates, input_tokens=100) == {
        "rtt1-slow"
    }
    assert _picks(build_policy(waw()), candidates, input_tokens=100) == {"rtt50-fast"}


def test_b47_both_ignore_flags_still_rank_by_comparator() -> None:
    candidates = (make_candidate("queued-2", queued=2), make_candidate("queued-1", queued=1))
    policy = build_policy(waw(ignore_queue_time=True, ignore_input_processing_time=True, n=2))
    assert _picks(policy, candidates, times=100) == {"queued-1"}


def test_b48_both_ignore_flags_lock_slow_rtt_bucket() -> None:
    candidates = (make_candidate("rtt5", rtt_ms=5.0), make_candidate("rtt50", rtt_ms=50.0))
    policy = build_policy(waw(ignore_queue_time=True, ignore_input_processing_time=True))
    assert _picks(policy, candidates, times=100) == {"rtt5"}
    full_fast = (make_candidate("rtt5", rtt_ms=5.0, running=1, max_concurrency=1), candidates[1])
    decision = policy.decide(full_fast, make_request(), rng())
    assert isinstance(decision, Wait) and decision.ms == pytest.approx(11.25)


def test_b49_infinite_ttft_never_unlocked() -> None:
    candidates = (make_candidate("no-capacity", tps=0.0, queued=10), make_candidate("finite", rtt_ms=500.0))
    assert _picks(build_policy(waw()), candidates, input_tokens=5, elapsed_ms=10_000.0) == {"finite"}
    full = (candidates[0], make_candidate("finite", rtt_ms=500.0, running=1, max_concurrency=1))
    assert isinstance(build_policy(waw()).decide(full, make_request(elapsed_ms=1e9), rng()), Unavailable)
    only_infinite = (candidates[0],)
    assert isinstance(build_policy(waw()).decide(only_infinite, make_request(), rng()), Unavailable)


def test_b50_queue_time_comparator_follows_priority() -> None:
    candidates = (
        make_candidate("first", queue_map={0: 1000, 4: 5}),
        make_candidate("second", queue_map={0: 0, 4: 500}),
    )
    policy = build_policy(waw(comparator=Comparator.QUEUE_TIME))
    assert _picks(policy, candidates, priority=4) == {"first"}
    assert _picks(policy, candidates) == {"second"}


def test_b51_nearest_lower_priority_and_sparse_maps() -> None:
    policy = build_policy(waw(comparator=Comparator.QUEUE_TIME))
    candidates = (make_candidate("five", queue_map={2: 5}), make_candidate("fifty", queue_map={2: 50}))
    assert _picks(policy, candidates, priority=10) == {"five"}
    candidates = (make_candidate("sparse", queue_map={4: 0}, queued=100), make_candidate("empty", queued=1))
    assert _picks(policy, candidates) == {"sparse"}


@pytest.mark.parametrize("flags", [{}, {"ignore_queue_time": True}])
def test_b52_num_requests_queued_in_general_and_fast_path(flags: dict[str, bool]) -> None:
    candidates = (
        make_candidate("busy", rtt_ms=5.0, queue_size=10),
        make_candidate("quiet", rtt_ms=50.0, queue_size=1),
    )
    policy = build_policy(waw(comparator=Comparator.NUM_REQUESTS_QUEUED, ttft_bucket_size_ms=100, **flags))
    assert _picks(policy, candidates, times=60) == {"quiet"}


def test_b53_excluded_fast_candidate() -> None:
    candidates = (make_candidate("fast", rtt_ms=1.0), make_candidate("slow", rtt_ms=90.0))
    assert _picks(build_policy(waw()), candidates, excluded={"fast"}) == {"slow"}
    assert isinstance(
        build_policy(waw()).decide(candidates, make_request(excluded={"fast", "slow"}), rng()), Unavailable
    )


def test_b55_no_key_ignores_ring() -> None:
    candidates = tuple(
        make_candidate(f"affinity-{x}", rtt_ms=r) for x, r in (("a", 1.0), ("b", 80.0), ("c", 90.0))
    )
    policy = build_policy(waw(selection_count=1, virtual_nodes=8, seed="seed-1", cache_affinity_wait_ms=200))
    picks = _picks(policy, candidates)
    assert picks == {"affinity-a"}
    assert chosen(policy.decide(candidates, make_request(), rng())).rank_depth == 1


def test_plain_wait_only_when_time_is_the_blocker() -> None:
    # Every bucket reachable but full: waiting for time alone does not help.
    candidates = (
        make_candidate("a", running=1, max_concurrency=1),
        make_candidate("b", rtt_ms=5.0, running=1, max_concurrency=1),
    )
    assert isinstance(build_policy(waw()).decide(candidates, make_request(), rng()), Unavailable)
    assert isinstance(build_policy(waw()).decide((), make_request(), rng()), Unavailable)


def test_buckets_chain_by_bucket_start() -> None:
    # 0 -> 30 (need 7.5) -> 70 (need 10): the third opens only after 17.5 ms in total.
    candidates = (
        make_candidate("t0", rtt_ms=0.0, running=1, max_concurrency=1),
        make_candidate("t30", rtt_ms=30.0, running=1, max_concurrency=1),
        make_candidate("t70", rtt_ms=70.0),
    )
    policy = build_policy(waw())
    first = policy.decide(candidates, make_request(elapsed_ms=5.0), rng())
    assert isinstance(first, Wait) and first.ms == pytest.approx(2.5)
    second = policy.decide(candidates, make_request(elapsed_ms=10.0), rng())
    assert isinstance(second, Wait) and second.ms == pytest.approx(7.5)
    assert chosen_id(candidates, policy.decide(candidates, make_request(elapsed_ms=17.5), rng())) == "t70"


def test_n_one_samples_uniformly_among_unlocked() -> None:
    candidates = (
        make_candidate("a", rtt_ms=1.0),
        make_candidate("b", rtt_ms=2.0),
        make_candidate("c", rtt_ms=3.0),
    )
    assert _picks(build_policy(waw(n=1)), candidates, times=200) == {"a", "b", "c"}
    assert _picks(build_policy(waw(n=3)), candidates, times=50) == {"a"}


def test_invalid_settings_are_config_errors() -> None:
    for scale in (1.5, -0.1, float("nan")):
        with pytest.raises(ConfigError, match="cache_affinity_input_tokens_scale"):
            build_policy(waw(cache_affinity_input_tokens_scale=scale))
    for scale in (0.0, 1.0):
        build_policy(waw(cache_affinity_input_tokens_scale=scale))
    with pytest.raises(ConfigError, match="consider_kv_free_tokens is supported only for pulsar"):
        build_policy(waw(consider_kv_free_tokens=True))
