"""Injected time: monotonic seconds for durations, wall time for publication, and sleeping.

Loops that wait (registration heartbeats, health probes, canaries, reconnect backoff) take a
``Clock`` so their tests drive time with ``ManualClock`` instead of sleeping.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def wall_ms(self) -> int: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock tests move: ``advance`` (sync) or ``tick`` (lets woken tasks run); wall time follows.

    ``sleep`` parks the caller until the clock passes its deadline; ``sleeping(n)`` waits until
    ``n`` callers are parked, so a test knows a loop reached its wait without polling.
    """

    def __init__(self, start: float = 1000.0, wall_start_ms: int = 1_700_000_000_000) -> None:
        self.now = start
        self._offset_ms = wall_start_ms - int(start * 1000)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._parked: asyncio.Event | None = None

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_ms() / 1000.0

    def wall_ms(self) -> int:
        return int(self.now * 1000) + self._offset_ms

    @property
    def pending(self) -> int:
        """Callers parked in ``sleep`` right now."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), future))
        self._parked_changed().set()
        try:
            await future
        finally:
            future.cancel()

    async def sleeping(self, count: int = 1, timeout: float = 10.0) -> None:
        """Wait (in real time, bounded) until at least ``count`` callers are parked in ``sleep``."""
        async with asyncio.timeout(timeout):
            while self.pending < count:
                changed = self._parked_changed()
                changed.clear()
                await changed.wait()

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self.now += seconds
        self._wake()

    async def tick(self, seconds: float) -> None:
        """Move time forward deadline by deadline, letting woken tasks run (and sleep again) at each."""
        end = self.now + seconds
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= end:
            self.now = max(self.now, self._sleepers[0][0])
            self._wake()
            await _settle()
        self.now = end
        await _settle()

    def _wake(self) -> None:
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    def _parked_changed(self) -> asyncio.Event:
        if self._parked is None:
            self._parked = asyncio.Event()
        return self._parked


async def _settle(rounds: int = 5) -> None:
    """A few trips through the event loop: woken tasks run until they wait again."""
    for _ in range(rounds):
        await asyncio.sleep(0)
