"""Token scheduler: one timer for all decoding requests, tokens emitted from a callback.

A decoding request is a :class:`Decode` with an ``emit(i) -> bool`` callback (write token ``i``;
False stops the request). Instead of one coroutine wake-up and one sleep per token, the scheduler
keeps a heap of absolute deadlines and a single timer armed for the earliest one; on expiry it
emits every due token. Deadlines are absolute (``start + Σ D_i``), so per-token overhead and timer
granularity never accumulate, and fractional millisecond delays hold on average.

The timer is injected (:class:`Timer`: ``time()`` and ``call_at(when, callback)``), so tests drive
it with a manual clock; production uses the event loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol

from .timing import RequestJitter, TimingConfig, decode_step_ms


class Handle(Protocol):
    def cancel(self) -> None: ...


class Timer(Protocol):
    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle: ...


class LoopTimer:
    """The running event loop as a :class:`Timer`."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop

    def _get(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def time(self) -> float:
        return self._get().time()

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle:
        return self._get().call_at(when, callback)


class Decode:
    """One request's decode: tokens ``0..n-1``; ``done`` resolves to the number emitted."""

    __slots__ = ("cancelled", "done", "emit", "emitted", "finished", "jitter", "n")

    def __init__(self, n: int, request_id: str, jitter_ms: int, emit: Callable[[int], bool]) -> None:
        self.n = n
        self.emit = emit
        self.emitted = 0
        self.cancelled = False
        self.finished = False
        self.jitter = RequestJitter(request_id, jitter_ms) if jitter_ms > 0 else None
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()


class DecodeScheduler:
    # A timer firing this early still emits: uvloop timers have millisecond granularity.
    SLACK_S = 0.0002

    def __init__(self, timing: TimingConfig, timer: Timer) -> None:
        self._timing = timing
        self._timer = timer
        self._heap: list[tuple[float, int, Decode]] = []
        self._seq = itertools.count()
        self._armed_at: float | None = None
        self._handle: Handle | None = None
        self._paused_at: float | None = None
        self.active = 0
        self.tokens_total = 0  # tokens emitted, counted as each is

    @property
    def decoding(self) -> int:
        return self.active

    def start(self, decode: Decode) -> None:
        """Emit token 0 now and schedule the rest."""
        self.active += 1
        self._step(decode, self._timer.time())
        self._arm()

    def cancel(self, decode: Decode) -> None:
        """Stop scheduling ``decode`` (its client went away); removed lazily from the heap."""
        if not decode.finished:
            decode.cancelled = True
            self._finish(decode)

    def step_s(self, decode: Decode, index: int) -> float:
        timing = self._timing
        if timing.batching == "continuous":
            base = decode_step_ms(timing, self.decoding)
        else:
            base = timing.token_delay_ms
        if decode.jitter is not None:
            base += decode.jitter.get(f"decode-{index}")
        return base / 1000.0

    def _finish(self, decode: Decode) -> None:
        decode.finished = True
        self.active -= 1
        if not decode.done.done():
            decode.done.set_result(decode.emitted)

    def _step(self, decode: Decode, deadline: float) -> None:
        """Emit the token due at ``deadline`` and push the next one."""
        index = decode.emitted
        if not decode.emit(index):
            self._finish(decode)
            return
        decode.emitted = index + 1
        self.tokens_total += 1
        if decode.emitted >= decode.n:
            self._finish(decode)
            return
        heapq.heappush(self._heap, (deadline + self.step_s(decode, decode.emitted), next(self._seq), decode))

    def _arm(self) -> None:
        if self._paused_at is not None or not self._heap:
            return
        due = self._heap[0][0]
        if self._armed_at is not None and self._armed_at <= due:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._armed_at = due
        self._handle = self._timer.call_at(due, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed_at = None
        if self._paused_at is not None:
            return
        limit = self._timer.time() + self.SLACK_S
        heap = self._heap
        while heap and heap[0][0] <= limit:
            deadline, _, decode = heapq.heappop(heap)
            if not decode.cancelled:
                self._step(decode, deadline)
        self._arm()

    def pause(self) -> None:
        if self._paused_at is None:
            self._paused_at = self._timer.time()
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None
                self._armed_at = None

    def resume(self) -> None:
        if self._paused_at is None:
            return
        shift = self._timer.time() - self._paused_at
        self._paused_at = None
        self._heap = [(deadline + shift, seq, decode) for deadline, seq, decode in self._heap]
        heapq.heapify(self._heap)
        self._arm()
