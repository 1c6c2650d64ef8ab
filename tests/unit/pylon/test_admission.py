from __future__ import annotations

import pytest

from stargate.pylon.admission import AdmissionConfig, Decision, Result, decide
from stargate.pylon.load import Phase

from .helpers import Rig, make_rig


def decision(
    rig: Rig, expected: str | None, rid: str = "new", priority: int = 0, enabled: bool = True
) -> Decision:
    return decide(
        AdmissionConfig(enabled=enabled),
        expected,
        load=rig.load,
        gen=rig.gen,
        request_id=rid,
        priority=priority,
        input_tps=rig.hub.input_tps(rig.gen),
        limit=rig.hub.effective_limit(rig.gen),
    )


def test_b66_queue_fields_and_estimates() -> None:
    rig = make_rig(initial_input_tps=100)
    rig.load.track("p2", rig.gen, 2, 20)
    rig.load.track("p4", rig.gen, 4, 30)
    rig.load.advance("p4", Phase.INPUT_PROCESSING)
    rig.load.track("p1", rig.gen, 1, 0)
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.queued_input_size, snap.num_running_queries) == (3, 50, 3)
    assert dict(snap.queue_time_estimate_ms_by_priority) == {0: 300, 2: 500}
    rig.load.release("p1")
    assert rig.hub.snapshot(rig.gen).queue_size == 2


def test_b67_explicit_empty_estimates() -> None:
    rig = make_rig(initial_input_tps=100)
    rig.load.track("a", rig.gen, 2, 20)
    assert rig.load.estimates(rig.gen, 100) == {2: 200}
    rig.load.release("a")
    assert rig.load.estimates(rig.gen, 100) == {}
    assert rig.load.estimates(rig.gen, 0) is None


def test_b68_output_generation_not_queued() -> None:
    rig = make_rig()
    rig.load.track("a", rig.gen, 0, 20)
    rig.load.advance("a", Phase.OUTPUT_GENERATION)
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.queued_input_size, snap.output_generation_queries) == (0, 0, 1)


def test_b69_phases_only_advance() -> None:
    rig = make_rig()
    rig.load.track("a", rig.gen, 0, 20)
    rig.load.advance("a", Phase.OUTPUT_GENERATION)
    rig.load.advance("a", Phase.INPUT_PROCESSING)
    assert rig.hub.snapshot(rig.gen).queue_size == 0


def test_b70_retrack_moves_load() -> None:
    rig = make_rig()
    other = rig.registry.allocate("other")
    rig.load.track("a", rig.gen, 0, 20)
    rig.load.track("a", other, 0, 20)
    assert rig.load.snapshot(rig.gen).num_running_queries == 0
    assert rig.load.snapshot(other).queued_input_size == 20


def test_b72_disabled() -> None:
    assert decision(make_rig(), "0", enabled=False).result is Result.DISABLED


def test_b73_missing_estimate() -> None:
    rig = make_rig()
    assert decision(rig, None).result is Result.MISSING_ESTIMATE
    assert decision(rig, "abc").result is Result.MISSING_ESTIMATE


def test_b74_unknown_then_rejected() -> None:
    rig = make_rig()
    rig.load.track("queued", rig.gen, 0, 100)
    assert decision(rig, "0").result is Result.UNKNOWN_LOCAL_ESTIMATE
    rig = make_rig(initial_input_tps=100)
    rig.load.track("queued", rig.gen, 0, 100)
    d = decision(rig, "0")
    assert (d.result, d.actual_ms, d.threshold_ms) == (Result.REJECTED, 1000, 25)


def test_b75_own_work_excluded() -> None:
    rig = make_rig(initial_input_tps=100)
    rig.load.track("new", rig.gen, 0, 10)
    d = decision(rig, "0")
    assert (d.result, d.actual_ms) == (Result.ACCEPTED, 0)


def test_b80_free_slot_rule() -> None:
    rig = make_rig(initial_input_tps=100, limit=4)
    for i in range(3):
        rig.load.track(f"other{i}", rig.gen, 0, 100_000)
    rig.load.track("new", rig.gen, 0, 10)
    d = decision(rig, "0")
    assert (d.result, d.actual_ms) == (Result.ACCEPTED, 0)
    rig.load.track("other3", rig.gen, 0, 100_000)
    assert decision(rig, "0").result is Result.REJECTED


def test_free_slot_accepts_even_without_tps() -> None:
    rig = make_rig(limit=2)
    rig.load.track("big", rig.gen, 0, 1000)
    assert decision(rig, "0").result is Result.ACCEPTED


def test_b22_initial_tps_estimate_map() -> None:
    rig = make_rig(initial_input_tps=1000)
    rig.load.track("q", rig.gen, 0, 1000)
    assert dict(rig.hub.snapshot(rig.gen).queue_time_estimate_ms_by_priority) == {0: 1000}


def test_priority_estimate_counts_only_more_urgent_work() -> None:
    rig = make_rig(initial_input_tps=100)
    rig.load.track("low", rig.gen, 5, 1000)
    d = decision(rig, "0", priority=2)
    assert (d.result, d.actual_ms) == (Result.ACCEPTED, 0)


def _decoding(rig: Rig, rid: str, *, held_s: float) -> None:
    """``rid`` took a free slot, has its first token and has held the slot for ``held_s``."""
    rig.load.track(rid, rig.gen, 0, 10)
    rig.load.sent(rid, rig.hub.effective_limit(rig.gen))
    rig.load.advance(rid, Phase.OUTPUT_GENERATION)
    rig.clock.advance(held_s)


def test_a_request_expected_to_start_at_once_counts_the_wait_for_a_slot() -> None:
    # The only slot holds an answer being decoded: no prompt work waits, yet the request would.
    rig = make_rig(initial_input_tps=100, limit=1)
    _decoding(rig, "a", held_s=0.5)
    rig.load.track("new", rig.gen, 0, 10)
    d = decision(rig, "0")
    assert (d.result, d.actual_ms, d.threshold_ms) == (Result.REJECTED, 500, 25)
    # Where the router expected a queue too, both sides compare prompt work, as in the spec.
    d = decision(rig, "40")
    assert (d.result, d.actual_ms) == (Result.ACCEPTED, 0)


def test_the_slot_wait_uses_the_measured_slot_time_once_requests_ended() -> None:
    rig = make_rig(initial_input_tps=100, limit=2)
    _decoding(rig, "a", held_s=0.0)
    _decoding(rig, "b", held_s=0.3)
    rig.load.release("a")  # held 0.3 s
    rig.load.release("b")  # held 0.3 s
    assert rig.load.slot_hold_s(rig.gen) == pytest.approx(0.3)
    _decoding(rig, "c", held_s=0.0)
    _decoding(rig, "d", held_s=5.0)  # the oldest running no longer decides
    rig.load.track("new", rig.gen, 0, 10)
    d = decision(rig, "0")
    assert d.result is Result.REJECTED and d.actual_ms in (150, 151)  # a slot frees every 0.3 s / 2


def test_a_slot_just_taken_is_no_reason_to_refuse() -> None:
    # A burst that just filled the engine: nothing known of how long a slot is held.
    rig = make_rig(initial_input_tps=100, limit=1)
    _decoding(rig, "a", held_s=0.0)
    rig.load.track("new", rig.gen, 0, 10)
    assert decision(rig, "0").result is Result.ACCEPTED


def test_requests_queued_at_the_engine_and_refused_ones_are_not_slot_time() -> None:
    rig = make_rig(initial_input_tps=100, limit=1)
    _decoding(rig, "a", held_s=0.0)
    rig.load.track("queued", rig.gen, 0, 10)
    rig.load.sent("queued", 1)  # no slot free: its time includes a wait
    rig.load.advance("queued", Phase.OUTPUT_GENERATION)
    rig.load.track("refused", rig.gen, 0, 10)  # never sent
    rig.clock.advance(1.0)
    rig.load.release("queued")
    rig.load.release("refused")
    assert rig.load.slot_hold_s(rig.gen) == pytest.approx(1.0)  # still the oldest running, "a"
    rig.load.release("a")
    assert rig.load.slot_hold_s(rig.gen) == pytest.approx(1.0)


def test_a_canary_holds_a_slot_for_admission_not_in_the_published_load() -> None:
    rig = make_rig(initial_input_tps=100, limit=1)
    _decoding(rig, "a", held_s=0.4)
    rig.load.release("a")  # slots are held 0.4 s here
    with rig.load.occupying(rig.gen):
        assert rig.hub.snapshot(rig.gen).num_running_queries == 0  # routers may send a request...
        rig.load.track("new", rig.gen, 0, 10)
        d = decision(rig, "0")  # ...which, sent for the slot, is refused and tried elsewhere
        assert d.result is Result.REJECTED and d.actual_ms in (400, 401)
    assert decision(rig, "0").result is Result.ACCEPTED
