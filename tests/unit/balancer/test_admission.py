from __future__ import annotations

from dataclasses import replace

import pytest
from support.balancer_builders import make_candidate, make_request

from stargate.balancer import AdmissionRejection, Algorithm, AlgorithmDefinition, check_admission
from stargate.balancer.admission import input_work_seconds


def _limit(
    seconds: float | None, algorithm: Algorithm = Algorithm.POWER_OF_N, **settings: object
) -> AlgorithmDefinition:
    return AlgorithmDefinition(algorithm, max_input_work_seconds=seconds, **settings)  # type: ignore[arg-type]


def test_worked_example_three_seconds() -> None:
    candidates = (make_candidate("a", queued=300, tps=100.0), make_candidate("b", queued=120, tps=50.0))
    request = make_request(input_tokens=30)
    assert input_work_seconds(_limit(3.0), candidates, request) == pytest.approx(3.0)
    assert check_admission(_limit(3.0), candidates, request) is None
    assert check_admission(_limit(2.99), candidates, request) is AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED


def test_b118_limit_exceeded() -> None:
    candidates = (make_candidate("a", queued=100, tps=100.0),)
    assert (
        check_admission(_limit(0.5), candidates, make_request(input_tokens=50))
        is AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED
    )
    assert AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED == "input_work_limit_exceeded"


def test_b119_no_capacity() -> None:
    candidates = (make_candidate("a", tps=0.0), make_candidate("b", tps=float("inf")))
    rejection = check_admission(_limit(10.0), candidates, make_request(input_tokens=5))
    assert rejection is AdmissionRejection.INPUT_WORK_CAPACITY_UNAVAILABLE
    assert rejection == "input_work_capacity_unavailable"


def test_admits_when_unset_or_everything_excluded() -> None:
    candidates = (make_candidate("a", queued=10**9, tps=1.0),)
    assert check_admission(_limit(None), candidates, make_request(input_tokens=5)) is None
    assert check_admission(_limit(0.1), candidates, make_request(excluded={"a"})) is None
    assert check_admission(_limit(0.1), (), make_request()) is None


def test_excluded_candidates_do_not_count() -> None:
    candidates = (make_candidate("fast", queued=0, tps=1000.0), make_candidate("slow", queued=1000, tps=10.0))
    assert check_admission(_limit(1.0), candidates, make_request(input_tokens=10)) is None
    assert check_admission(_limit(1.0), candidates, make_request(input_tokens=10, excluded={"fast"})) is (
        AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED
    )


def test_invalid_tps_adds_work_but_no_rate_for_other_algorithms() -> None:
    candidates = (make_candidate("a", queued=100, tps=100.0), make_candidate("dead", queued=100, tps=0.0))
    assert input_work_seconds(_limit(9.0), candidates, make_request()) == pytest.approx(2.0)


def test_pulsar_family_counts_only_ranked_feasible_candidates() -> None:
    candidates = (
        make_candidate("a", queued=100, tps=100.0, kv_free=1000, kv_capacity=2000),
        make_candidate("dead", queued=100, tps=0.0, kv_free=1000, kv_capacity=2000),
        make_candidate("no-kv", queued=900, tps=100.0),
    )
    request = make_request(input_tokens=50)
    for algorithm in (Algorithm.PULSAR, Algorithm.PULSAR_WAIT_AND_WIDEN):
        assert input_work_seconds(_limit(9.0, algorithm), candidates, request) == pytest.approx(1050 / 200)
        kv_aware = _limit(9.0, algorithm, consider_kv_free_tokens=True)
        assert input_work_seconds(kv_aware, candidates, request) == pytest.approx(150 / 100)
        only_unfit = make_request(input_tokens=50, excluded={"a"})
        assert (
            check_admission(kv_aware, candidates, only_unfit)
            is AdmissionRejection.INPUT_WORK_CAPACITY_UNAVAILABLE
        )


def test_total_query_input_size_is_ignored() -> None:
    from dataclasses import replace

    candidate = make_candidate("a", queued=0, tps=100.0)
    heavy = replace(candidate, stats=replace(candidate.stats, total_query_input_size=10**9))
    assert check_admission(_limit(1.0), (heavy,), make_request(input_tokens=50)) is None


def test_free_slot_does_not_relax_admission() -> None:
    candidate = make_candidate("a", queued=1000, tps=100.0, running=0, max_concurrency=8)
    assert (
        check_admission(_limit(5.0), (candidate,), make_request())
        is AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED
    )


def test_a_prompt_expected_cached_counts_whole_where_pylon_counts_it_whole() -> None:
    """Spec §3.10: queued work is never scaled; ``pylon_stats`` counts what the ranking discounts."""
    discounted = make_candidate("a", queued=100, tps=1000.0)
    counted = replace(discounted, pylon_stats=replace(discounted.stats, queued_input_size=1000))
    assert input_work_seconds(_limit(0.5), (discounted,), make_request()) == pytest.approx(0.1)
    assert input_work_seconds(_limit(0.5), (counted,), make_request()) == pytest.approx(1.0)
    assert (
        check_admission(_limit(0.5), (counted,), make_request())
        is AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED
    )
