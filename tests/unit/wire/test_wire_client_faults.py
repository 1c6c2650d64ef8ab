from __future__ import annotations

import logging

import pytest

from stargate.wire.client_faults import MAX_DETAIL_CHARS, ClientFaults, Fault, detail

LOGGER = "test.client_faults"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, burst: int = 3, per_s: float = 0.5) -> ClientFaults:
    return ClientFaults(logging.getLogger(LOGGER), burst=burst, per_s=per_s, clock=clock)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_burst_then_suppressed_then_one_summary_line_when_it_opens(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    faults = make(clock)
    caplog.set_level(logging.WARNING, LOGGER)
    logged = [faults.report(Fault.MALFORMED, "bad request %d", i) for i in range(10)]
    assert logged == [True] * 3 + [False] * 7
    assert lines(caplog) == ["bad request 0", "bad request 1", "bad request 2"]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in caplog.records)
    caplog.clear()
    clock.now += 1.9  # 0.95 tokens at 0.5 a second: still closed
    assert not faults.report(Fault.MALFORMED, "bad request %d", 10)
    clock.now += 0.1
    assert faults.report(Fault.MALFORMED, "bad request %d", 11)
    assert lines(caplog) == ["suppressed 8 similar messages (malformed request)", "bad request 11"]


def test_each_kind_has_its_own_bucket_and_the_bucket_never_exceeds_the_burst(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    faults = make(clock, burst=1)
    caplog.set_level(logging.WARNING, LOGGER)
    assert faults.report(Fault.MALFORMED, "a")
    assert not faults.report(Fault.MALFORMED, "b")
    assert faults.report(Fault.SLOW_HEAD, "c")
    clock.now += 3600.0
    assert [faults.report(Fault.RESPONSE_ABANDONED, "d") for _ in range(2)] == [True, False]
    assert lines(caplog) == ["a", "c", "d"]


def test_detail_is_one_short_printable_line() -> None:
    assert detail("Bad status line:\r\n\n  b'G@T'\x1b[2J") == "Bad status line: b'G@T'\\x1b[2J"
    long = detail("x" * 1000)
    assert len(long) == MAX_DETAIL_CHARS and long.endswith("...")
