"""A manual :class:`~stargate.mock_engine.scheduler.Timer` for exact scheduler tests."""

from __future__ import annotations

from collections.abc import Callable


class ManualTimer:
    """A clock the test advances; fires due callbacks in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending: list[tuple[float, Callable[[], None], list[bool]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        flag = [False]
        self.pending.append((when, callback, flag))
        return _Handle(flag)

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            live = sorted((p for p in self.pending if not p[2][0] and p[0] <= end), key=lambda p: p[0])
            if not live:
                break
            when, callback, _flag = live[0]
            self.pending.remove(live[0])
            self.now = max(self.now, when)
            callback()
        self.now = end


class _Handle:
    def __init__(self, flag: list[bool]) -> None:
        self._flag = flag

    def cancel(self) -> None:
        self._flag[0] = True


def recorder(timer: ManualTimer, times: list[float]) -> Callable[[int], bool]:
    def emit(_: int) -> bool:
        times.append(timer.time())
        return True

    return emit
