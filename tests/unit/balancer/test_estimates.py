from __future__ import annotations

import math
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.balancer_builders import make_candidate, make_request, make_stats, rng

from stargate.balancer import (
    Algorithm,
    AlgorithmDefinition,
    Wait,
    build_policy,
    effective_queue_ms,
    has_free_slot,
    queue_estimate,
    with_reservation,
    with_reservations,
)
from stargate.balancer.estimates import U64_MAX, prefill_ms, queue_ms, ttft_ms
from stargate.balancer.types import ModelStats


def test_b21_priority_map_uses_greatest_key_not_above_priority() -> None:
    assert queue_estimate(make_stats(queue_map={1: 10, 4: 40}), 3) == 10
    assert queue_estimate(make_stats(queue_map={4: 250}), 0) == 0
    assert queue_estimate(make_stats(queue_map={1: 10, 4: 40}), 4) == 40


def test_b22_aggregate_estimate_from_queued_work() -> None:
    assert queue_estimate(make_stats(queued=25, tps=100.0), 0) == 250
    assert queue_estimate(make_stats(queued=25, tps=0.0), 0) is None


def test_b23_aggregate_estimate_rounds_up_and_handles_no_work() -> None:
    assert queue_estimate(make_stats(queued=1, tps=3.0), 0) == 334
    assert queue_estimate(make_stats(queued=0, tps=0.0), 0) == 0
    assert queue_estimate(make_stats(queued=0, tps=math.nan), 0) == 0
    assert queue_estimate(make_stats(queued=5, tps=math.inf), 0) is None
    assert queue_estimate(make_stats(queued=U64_MAX, tps=1e-300), 0) is None


def test_b24_ttft_components() -> None:
    candidate = make_candidate("c", rtt_ms=7.0, queue_map={4: 25}, queued=999, tps=100.0)
    assert queue_ms(candidate.stats, 4) == 25.0
    assert prefill_ms(candidate.stats, 200) == 2000.0
    assert ttft_ms(candidate.stats, candidate.rtt_s, 200, 4) == pytest.approx(2032.0)


@pytest.mark.parametrize(
    ("flags", "bucket_ttft"),
    [({}, 2032.0), ({"ignore_queue_time": True}, 2007.0), ({"ignore_input_processing_time": True}, 32.0)],
)
def test_b24_ignore_flags_shape_bucket_ttft(flags: dict[str, bool], bucket_ttft: float) -> None:
    # A full, near-zero-TTFT cluster opens the first bucket; with factor 1 and bucket 0 the wait
    # hint equals the worked example's bucket TTFT.
    fast_full = make_candidate("fast", rtt_ms=0.0, tps=1e15, running=1, max_concurrency=1)
    example = make_candidate("example", rtt_ms=7.0, queue_map={4: 25}, queued=999, tps=100.0)
    definition = AlgorithmDefinition(
        Algorithm.WAIT_AND_WIDEN, ttft_bucket_size_ms=0, next_bucket_unlock_factor=1.0, **flags
    )
    decision = build_policy(definition).decide(
        (fast_full, example), make_request(input_tokens=200, priority=4), rng()
    )
    assert isinstance(decision, Wait)
    assert decision.ms == pytest.approx(bucket_ttft, abs=1e-6)


def test_b27_free_slot_zeroes_effective_queue() -> None:
    stats = make_stats(max_concurrency=8, running=3, queued=100_000, tps=10.0, queue_map={0: 9000})
    assert has_free_slot(stats)
    assert effective_queue_ms(stats, 0) == 0
    assert queue_estimate(stats, 0) == 9000
    assert ttft_ms(stats, 0.005, 100, 0) == pytest.approx(5.0 + 10_000.0)


def test_b28_full_cluster_uses_backlog_again() -> None:
    stats = make_stats(max_concurrency=8, running=7, queued=1000, tps=10.0)
    filled = with_reservation(stats, 0, 0)
    assert filled.num_running_queries == 8
    assert not has_free_slot(filled)
    assert effective_queue_ms(filled, 0) == 100_000
    assert effective_queue_ms(stats, 0) == 0


def test_b29_unknown_concurrency_keeps_snapshot_estimate() -> None:
    stats = make_stats(max_concurrency=0, running=0, queued=25, tps=100.0)
    assert not has_free_slot(stats)
    assert effective_queue_ms(stats, 0) == 250


def test_effective_queue_unknown_when_raw_unknown_and_no_slot() -> None:
    assert effective_queue_ms(make_stats(queued=5, tps=0.0), 0) is None
    assert queue_ms(make_stats(queued=5, tps=0.0), 0) == math.inf


@pytest.mark.parametrize(
    ("before", "tokens", "priority", "after"),
    [
        ({2: 5}, 10, 3, {2: 5, 3: 105}),
        ({1: 10, 4: 40}, 10, 2, {1: 10, 2: 110, 4: 140}),
        ({4: 5}, 10, 0, {0: 100, 4: 105}),
        ({}, 10, 0, {}),
        ({1: 10, 2: 100, 4: 400}, 10, 2, {1: 10, 2: 200, 4: 500}),  # b94
    ],
)
def test_reservation_priority_map_bump(
    before: dict[int, int], tokens: int, priority: int, after: dict[int, int]
) -> None:
    stats = with_reservation(make_stats(tps=100.0, queue_map=before), tokens, priority)
    assert dict(stats.queue_time_estimate_ms_by_priority) == after


def test_b91_reservation_counters() -> None:
    stats = make_stats(tps=100.0, queue_map={4: 5}, max_concurrency=16, kv_free=9)
    reserved = with_reservation(stats, 37, 4)
    assert reserved.num_running_queries == 1
    assert reserved.queue_size == 1
    assert reserved.queued_input_size == 37
    assert reserved.total_query_input_size == 37
    assert dict(reserved.queue_time_estimate_ms_by_priority) == {4: 375}
    assert (reserved.last_mean_input_tps, reserved.max_engine_concurrency, reserved.kv_cache_free_tokens) == (
        100.0,
        16,
        9,
    )
    assert stats.num_running_queries == 0  # the published snapshot is untouched


def test_b93_reservation_on_summed_tps() -> None:
    reserved = with_reservation(make_stats(tps=200.0, queue_map={4: 5}), 37, 4)
    assert dict(reserved.queue_time_estimate_ms_by_priority) == {4: 190}


def test_b92_reservations_fold_independently() -> None:
    base = make_stats(tps=100.0, queue_map={0: 0})
    both = with_reservation(with_reservation(base, 10, 0), 20, 0)
    only_second = with_reservation(base, 20, 0)
    assert both.queued_input_size == 30 and dict(both.queue_time_estimate_ms_by_priority) == {0: 300}
    assert only_second.queued_input_size == 20 and dict(only_second.queue_time_estimate_ms_by_priority) == {
        0: 200
    }


def test_b94_invalid_tps_clears_map() -> None:
    stats = with_reservation(make_stats(tps=0.0, queue_map={1: 10, 2: 100, 4: 400}), 10, 2)
    assert dict(stats.queue_time_estimate_ms_by_priority) == {}


def test_reservation_saturates() -> None:
    stats = make_stats(queued=U64_MAX - 1, queue_map={0: U64_MAX - 1}, tps=1.0)
    reserved = with_reservation(stats, 5, 0)
    assert reserved.queued_input_size == U64_MAX
    assert reserved.queue_time_estimate_ms_by_priority[0] == U64_MAX


def test_reservation_map_is_read_only() -> None:
    reserved = with_reservation(make_stats(queue_map={0: 1}), 1, 0)
    assert isinstance(reserved.queue_time_estimate_ms_by_priority, MappingProxyType)


def test_scaled_prefill_never_rescues_invalid_tps() -> None:
    assert prefill_ms(make_stats(tps=0.0), 10, 0.0) == math.inf
    assert prefill_ms(make_stats(tps=100.0), 10, 0.0) == 0.0
    assert prefill_ms(make_stats(tps=0.0), 0, 1.0) == 0.0
    assert prefill_ms(make_stats(tps=100.0), 100, 0.5) == 500.0


def _counters(s: ModelStats) -> list[int]:
    return [s.queue_size, s.queued_input_size, s.num_running_queries, s.total_query_input_size]


def _spec_fold(stats: ModelStats, pending: list[tuple[int, int]]) -> tuple[list[int], dict[int, int]]:
    """§1.9 applied one reservation at a time, written from the spec as the reference."""
    counters = _counters(stats)
    estimates = dict(stats.queue_time_estimate_ms_by_priority)
    tps = stats.last_mean_input_tps
    for tokens, priority in pending:
        counters = [min(U64_MAX, c + d) for c, d in zip(counters, (1, tokens, 1, tokens), strict=True)]
        if not estimates:
            continue
        if tokens and not (0.0 < tps < math.inf):
            estimates = {}
            continue
        millis = tokens / tps * 1000.0 if tokens else 0.0
        delta = U64_MAX if millis >= U64_MAX else math.ceil(millis)
        floor = max((k for k in estimates if k <= priority), default=None)
        base = estimates[floor] if floor is not None else 0
        estimates = {k: min(U64_MAX, v + delta) if k > priority else v for k, v in estimates.items()}
        estimates[priority] = min(U64_MAX, base + delta)
    return counters, estimates


@settings(max_examples=300, deadline=None)
@given(
    queue_map=st.dictionaries(st.integers(-3, 6), st.integers(0, U64_MAX), max_size=4),
    tps=st.sampled_from([0.0, 0.5, 7.0, 1000.0, math.inf]),
    pending=st.lists(st.tuples(st.sampled_from([0, 1, 37, 10**6, U64_MAX]), st.integers(-4, 7)), max_size=6),
)
def test_reservations_applied_at_once_equal_one_at_a_time_in_any_order(
    queue_map: dict[int, int], tps: float, pending: list[tuple[int, int]]
) -> None:
    stats = make_stats(tps=tps, queue_map=queue_map, queued=3, running=2)
    at_once = with_reservations(stats, pending)
    for order in (pending, pending[::-1]):
        counters, estimates = _spec_fold(stats, order)
        assert _counters(at_once) == counters
        assert dict(at_once.queue_time_estimate_ms_by_priority) == estimates
        if pending:
            assert list(at_once.queue_time_estimate_ms_by_priority) == sorted(estimates)
    assert with_reservations(stats, []) is stats
