"""Injected time source: monotonic seconds for durations, wall milliseconds for publication."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall_ms(self) -> int: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock tests advance explicitly; wall time moves with monotonic time."""

    def __init__(self, start: float = 1000.0, wall_start_ms: int = 1_700_000_000_000) -> None:
        self.now = start
        self._offset_ms = wall_start_ms - int(start * 1000)

    def monotonic(self) -> float:
        return self.now

    def wall_ms(self) -> int:
        return int(self.now * 1000) + self._offset_ms

    def advance(self, seconds: float) -> None:
        self.now += seconds
