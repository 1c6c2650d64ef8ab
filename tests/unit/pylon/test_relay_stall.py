"""Pylon's silence check on an upstream body (``relay._Stall``), on a driven clock, no sockets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stargate.pylon.relay import _Stall


@dataclass
class _Content:
    total_bytes: int = 0
    eof: bool = False

    def is_eof(self) -> bool:
        return self.eof


@dataclass
class _Upstream:
    content: _Content = field(default_factory=_Content)
    connection: None = None
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class _Handle:
    def cancel(self) -> None:
        pass


@dataclass
class _Loop:
    """The loop's clock and timers, moved by the test: ``fire`` runs the check at a given time."""

    now: float = 0.0
    due: float = 0.0
    callback: Callable[[], None] | None = None

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        self.due, self.callback = when, callback
        return _Handle()

    def fire(self, at: float) -> None:
        self.now = at
        assert self.callback is not None
        self.callback()


def _stall(limit_s: float = 3.0) -> tuple[_Stall, _Upstream, _Loop]:
    upstream, loop = _Upstream(), _Loop()
    stall = _Stall(upstream, limit_s, loop)  # type: ignore[arg-type]
    stall.arrived()
    stall.waiting()  # the body began; the relay waits for its next chunk from t=0
    return stall, upstream, loop


def test_a_body_silent_for_the_limit_is_closed() -> None:
    _, upstream, loop = _stall()
    for _ in range(3):
        loop.fire(loop.due)  # every second: the check runs on time
    assert upstream.closed


def test_a_check_that_runs_late_only_rearms() -> None:
    # The whole process was stopped (SIGSTOP) for 35 s: on resume the timer runs before the relay
    # has read what the engine sent meanwhile, so its silence is not the engine's.
    _, upstream, loop = _stall()
    loop.fire(35.0)
    assert not upstream.closed
    loop.fire(loop.due)  # on time again, and nothing came: silence
    assert upstream.closed


def test_bytes_that_reached_the_connection_are_not_silence() -> None:
    _, upstream, loop = _stall()
    loop.fire(loop.due)
    loop.fire(loop.due)
    upstream.content.total_bytes += 100  # arrived, not yet read by the relay
    loop.fire(loop.due)
    assert not upstream.closed
