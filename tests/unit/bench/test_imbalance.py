"""The time-resolved in-flight imbalance on hand-computed series."""

from __future__ import annotations

import pytest

from stargate.bench.imbalance import in_flight_imbalance, weighted_quantile


def test_even_then_one_sided() -> None:
    # [0, 2): a=1, b=1 -> max/mean 1; [2, 4): a=1, b=0 -> 1 / (1/2) = 2
    found = in_flight_imbalance([("a", 0.0, 4.0), ("b", 0.0, 2.0)], ["a", "b"])
    assert found.mean == pytest.approx(1.5) and found.p99 == 2.0 and found.busy_s == 4.0


def test_moments_with_nothing_in_flight_are_left_out() -> None:
    found = in_flight_imbalance([("a", 0.0, 1.0), ("a", 3.0, 4.0)], ["a", "b"])
    assert found.busy_s == 2.0 and found.mean == 2.0 and found.p99 == 2.0


def test_idle_backends_count_and_unknown_ones_join() -> None:
    assert in_flight_imbalance([("a", 0.0, 1.0)], ["a", "b", "c"]).mean == 3.0
    assert in_flight_imbalance([("a", 0.0, 1.0), ("x", 0.0, 1.0)], ["a"]).mean == 1.0


def test_pile_up_weighted_by_time() -> None:
    # four backends; [0, 1): 3 on a, 1 on b -> 3 / (4/4) = 3; [1, 10): one each -> 1
    spans = [("a", 0.0, 1.0), ("a", 0.0, 1.0), ("a", 0.0, 10.0), ("b", 0.0, 10.0),
             ("c", 1.0, 10.0), ("d", 1.0, 10.0)]  # fmt: skip
    found = in_flight_imbalance(spans, ["a", "b", "c", "d"])
    assert found.mean == pytest.approx((3 * 1 + 1 * 9) / 10)
    assert found.p99 == 3.0  # 10 % of the busy time is at 3


def test_simultaneous_end_and_start_and_empty_input() -> None:
    found = in_flight_imbalance([("a", 0.0, 1.0), ("b", 1.0, 2.0), ("b", 2.0, 2.0)], ["a", "b"])
    assert found.mean == 2.0 and found.busy_s == 2.0
    empty = in_flight_imbalance([], ["a", "b"])
    assert (empty.mean, empty.p99, empty.busy_s) == (None, None, 0.0)


def test_weighted_quantile() -> None:
    assert weighted_quantile([(1.0, 99.5), (4.0, 0.5)], 0.99) == 1.0
    assert weighted_quantile([(1.0, 98.0), (3.0, 2.0)], 0.99) == 3.0
    assert weighted_quantile([], 0.99) is None


def test_per_slot_counts_a_big_backend_by_its_slots() -> None:
    # a has 6 slots, b 2: 3 on a and 1 on b fill both to half -> 1 per slot, 1.5 plain (3 / (4/2))
    spans = [("a", 0.0, 1.0)] * 3 + [("b", 0.0, 1.0)]
    assert in_flight_imbalance(spans, ["a", "b"]).mean == 1.5
    assert in_flight_imbalance(spans, ["a", "b"], {"a": 6.0, "b": 2.0}).mean == pytest.approx(1.0)
    # all 4 on the small backend: 4/2 per slot against 4/8 -> 4 (the slot share of b is 1/4)
    small = [("b", 0.0, 1.0)] * 4
    assert in_flight_imbalance(small, ["a", "b"], {"a": 6.0, "b": 2.0}).mean == pytest.approx(4.0)
    # equal slots: the same as the plain measure
    assert in_flight_imbalance(spans, ["a", "b"], {"a": 3.0, "b": 3.0}).mean == pytest.approx(1.5)
