"""Pylon's silence check on an upstream body (``relay._Stall``), driven without sockets."""

from __future__ import annotations

import time
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


async def test_bytes_that_came_while_the_process_was_stopped_are_not_silence() -> None:
    upstream = _Upstream()
    stall = _Stall(upstream, limit_s=0.05)  # type: ignore[arg-type]
    try:
        stall.arrived()
        stall.waiting()
        time.sleep(0.06)  # the whole process stopped (SIGSTOP): no callback ran meanwhile
        upstream.content.total_bytes += 100  # the engine's last tokens, in the socket, not yet read
        stall._check()  # on resume the check runs before the relay reads them
        assert not upstream.closed
        stall.waiting()  # the relay read them and waits again: now silence is silence
        time.sleep(0.06)
        stall._check()
        assert upstream.closed
    finally:
        stall.stop()
