from __future__ import annotations

import math

import pytest
from support.balancer_builders import chosen_id, make_candidate, make_request, rng

from stargate.balancer import Algorithm, AlgorithmDefinition, Comparator, build_policy
from stargate.balancer.comparators import (
    input_work_seconds_score,
    num_requests_queued_score,
    queue_time_score,
    ttft_score,
    utilization_score,
)


def _power_of_two(comparator: Comparator) -> AlgorithmDefinition:
    return AlgorithmDefinition(Algorithm.POWER_OF_N, sample_count=2, comparator=comparator)


@pytest.mark.parametrize(
    ("comparator", "winner", "loser"),
    [
        (
            Comparator.QUEUE_TIME,
            make_candidate("win", rtt_ms=100.0, queue_map={0: 1}),
            make_candidate("lose", rtt_ms=1.0, queue_map={0: 50}),
        ),
        (
            Comparator.INPUT_WORK_SECONDS,
            make_candidate("win", tps=1000.0, queued=100),
            make_candidate("lose", tps=10.0, queued=100),
        ),
        (
            Comparator.UTILIZATION,
            make_candidate("win", running=1, max_concurrency=10),
            make_candidate("lose", running=9, max_concurrency=10),
        ),
        (
            Comparator.NUM_REQUESTS_QUEUED,
            make_candidate("win", rtt_ms=100.0, queue_size=1),
            make_candidate("lose", rtt_ms=1.0, queue_size=10),
        ),
        (Comparator.TTFT, make_candidate("win", rtt_ms=1.0), make_candidate("lose", rtt_ms=100.0)),
    ],
)
def test_b25_each_comparator_prefers_lower_score(
    comparator: Comparator, winner: object, loser: object
) -> None:
    policy = build_policy(_power_of_two(comparator))
    random_source = rng()
    for candidates in ((winner, loser), (loser, winner)):
        for _ in range(20):
            decision = policy.decide(candidates, make_request(input_tokens=10), random_source)  # type: ignore[arg-type]
            assert chosen_id(candidates, decision) == "win"  # type: ignore[arg-type]


def test_b26_input_work_without_capacity() -> None:
    idle = make_candidate("c", tps=0.0, queued=0)
    assert input_work_seconds_score(idle, 0, 0) == 0.0
    assert input_work_seconds_score(idle, 0, 1) == math.inf
    assert input_work_seconds_score(make_candidate("c", tps=0.0, queued=3), 0, 0) == math.inf
    assert input_work_seconds_score(make_candidate("c", tps=100.0, queued=150), 0, 50) == 2.0


def test_scores_read_snapshot_fields() -> None:
    candidate = make_candidate(
        "c", rtt_ms=7.0, queue_map={4: 25}, queued=999, tps=100.0, queue_size=3, running=2
    )
    assert ttft_score(candidate, 4, 200) == pytest.approx(2032.0)
    assert queue_time_score(candidate, 4, 200) == 25.0
    assert num_requests_queued_score(candidate, 0, 0) == 3.0
    assert utilization_score(candidate, 0, 0) == 2.0  # unknown limit counts as 1


def test_b27_free_slot_applies_to_queue_comparators_in_power_of_n() -> None:
    # Backlogged but with a free slot vs idle-looking but at its limit.
    free_slot = make_candidate("free", queued=100_000, tps=100.0, running=3, max_concurrency=8)
    at_limit = make_candidate("full", queue_map={0: 50}, running=8, max_concurrency=8)
    assert queue_time_score(free_slot, 0, 0) == 0.0
    assert ttft_score(free_slot, 0, 100) == pytest.approx(1.0 + 1000.0)
    for comparator in (Comparator.QUEUE_TIME, Comparator.TTFT):
        policy = build_policy(_power_of_two(comparator))
        decision = policy.decide((at_limit, free_slot), make_request(), rng())
        assert chosen_id((at_limit, free_slot), decision) == "free"


def test_free_slot_does_not_change_load_comparators() -> None:
    candidate = make_candidate("c", queued=500, tps=100.0, running=3, max_concurrency=8, queue_size=4)
    assert input_work_seconds_score(candidate, 0, 0) == 5.0
    assert num_requests_queued_score(candidate, 0, 0) == 4.0
    assert utilization_score(candidate, 0, 0) == 3 / 8
