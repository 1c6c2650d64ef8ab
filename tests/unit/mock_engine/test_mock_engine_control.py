from __future__ import annotations

import asyncio

import pytest

from stargate.mock_engine.control import FaultError, Faults, TestControl, request_class


def test_s9_5_blank_discovery_model_rejected_and_set_unchanged() -> None:
    control = TestControl("dummy-model")
    with pytest.raises(FaultError, match="model IDs must be non-empty"):
        control.set_discovery(["a", " "])
    assert control.discovered == ["dummy-model"]
    control.set_discovery([" b", "a", "b"])
    assert control.discovered == ["a", "b"]


def test_s9_46_request_classes() -> None:
    assert request_class("calibration-x") == "pylon_generated"
    assert request_class("canary-y") == "pylon_generated"
    assert request_class("user-z") == "api_gateway"
    assert request_class("") == "api_gateway"


def test_counter_snapshot_order() -> None:
    control = TestControl("m")
    arrivals = [
        ("embeddings", "api_gateway"), ("chat_completions", "api_gateway"),
        ("chat_completions", "pylon_generated"), ("responses", "api_gateway"),
    ]  # fmt: skip
    for endpoint, klass in arrivals:
        control.count(endpoint, "m", klass)
    rows = [(row["endpoint"], row["request_class"]) for row in control.snapshot()["counters"]]
    assert rows == [
        ("chat_completions", "pylon_generated"), ("chat_completions", "api_gateway"),
        ("responses", "api_gateway"), ("embeddings", "api_gateway"),
    ]  # fmt: skip


def test_fail_next_counts_down() -> None:
    faults = Faults()
    faults.update({"fail_next": 2, "fail_status": 429, "fail_retryable": True})
    plans = [faults.take() for _ in range(3)]
    assert [p.failure.status if p.failure else None for p in plans] == [429, 429, None]
    assert plans[0].failure is not None and plans[0].failure.retryable


def test_hang_latency_and_drop_plans() -> None:
    faults = Faults()
    faults.update(
        {"extra_latency_ms": 20, "hang_next": 1, "hang_ms": 500, "drop_next": 1, "drop_after_chunks": 3}
    )
    first, second = faults.take(), faults.take()
    assert first.delay_s == pytest.approx(0.52) and first.drop_after_chunks == 3
    assert second.delay_s == pytest.approx(0.02) and second.drop_after_chunks is None


def test_invalid_fault_fields_rejected_without_partial_update() -> None:
    faults = Faults()
    with pytest.raises(FaultError, match="fail_status"):
        faults.update({"fail_next": 3, "fail_status": 200})
    assert faults.fail_next == 0
    with pytest.raises(FaultError, match="unknown fault field"):
        faults.update({"bogus": 1})


async def test_s9_45_bringup_hold_releases_on_unblock() -> None:
    control = TestControl("m")
    control.set_model("m", {"bringup_blocked": True})
    held = asyncio.create_task(control.bringup_hold("m", "pylon_generated"))
    await control.bringup_hold("m", "api_gateway")  # never held
    await asyncio.sleep(0)
    assert not held.done()
    control.set_model("m", {"bringup_blocked": False})
    await asyncio.wait_for(held, 1.0)
    assert control.models["m"] == {"chat_failure": False, "bringup_blocked": False}
