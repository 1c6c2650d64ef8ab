"""Engine state shared by the handlers: configuration, concurrency slots, prefill scheduling.

The time source is injected (``clock`` returns monotonic seconds, ``sleep`` awaits a duration) so
tests drive the timing model exactly without sleeping. Only the continuous-batching prefill pool
uses the event loop's timers directly; its arithmetic lives in the pure
:class:`~stargate.mock_engine.timing.ProcessorSharing`.

A generating request takes a *seat* (:meth:`Engine.enter`): a concurrency slot in the
``independent`` and ``continuous`` modes, a :class:`~stargate.mock_engine.steps.Sequence` of the
step scheduler in ``vllm`` mode, which then owns admission, prefill and decode.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from stargate.wire.limits import MAX_BODY_BYTES

from .control import TestControl
from .kv_cache import AffinityKVCache, KVCache, PrefixKVCache
from .request_log import ArrivalLog, RequestLog
from .scheduler import Decode, DecodeScheduler, LoopTimer, Timer
from .stats_stream import StatsHub
from .steps import QueueFull, Sequence, StepScheduler
from .timing import ProcessorSharing, TimingConfig, prefill_seconds

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
KVMode = Literal["affinity", "prefix"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "dummy-model"
    backend_id: str = ""
    timing: TimingConfig = field(default_factory=TimingConfig)
    max_concurrent_requests: int = 0
    max_waiting_requests: int = 100_000
    health_delay_ms: float = 0.0
    kv_cache_capacity_tokens: int = 0
    kv_cache_mode: KVMode = "affinity"
    kv_block_size: int = 16
    request_log: str | None = None
    arrival_log: str | None = None
    responses_stream_only: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    max_model_len: int = 1_000_000


class Slots:
    """FIFO concurrency slots; ``limit`` 0 means unlimited (only counted)."""

    def __init__(self, limit: int, max_waiting: int) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.limit <= 0 or (self.running < self.limit and not self._waiters):
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just before the cancellation
            elif waiter in self._waiters:  # a release may have dropped it, cancelled, already
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # hand the slot over: running stays the same
                return
        self.running -= 1


class PrefillPool:
    """Continuous batching: concurrent prefills share the engine's prefill throughput equally."""

    def __init__(self, tokens_per_s: float) -> None:
        self._tps = tokens_per_s
        self._ps: ProcessorSharing | None = None
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._waiters)

    async def run(self, tokens: int) -> None:
        loop = asyncio.get_running_loop()
        if self._ps is None:
            self._ps = ProcessorSharing(self._tps, loop.time())
        job = next(self._ids)
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters[job] = waiter
        self._ps.add(job, tokens, loop.time())
        self._schedule(loop)
        try:
            await waiter
        finally:
            if self._waiters.pop(job, None) is not None:
                self._ps.remove(job, loop.time())
                self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        assert self._ps is not None
        due = self._ps.next_finish(loop.time())
        if due is not None:
            self._timer = loop.call_at(due, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        assert self._ps is not None
        for job in self._ps.pop_finished(loop.time()):
            waiter = self._waiters.pop(job, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._schedule(loop)


@dataclass(frozen=True, slots=True)
class SlotSeat:
    """A concurrency slot; ``admit`` runs once it is held and returns the tokens to prefill."""

    admit: Callable[[], int]


Seat = SlotSeat | Sequence


def make_kv_cache(config: EngineConfig) -> KVCache:
    if config.kv_cache_mode == "prefix":
        return PrefixKVCache(config.kv_cache_capacity_tokens, config.kv_block_size)
    return AffinityKVCache(config.kv_cache_capacity_tokens)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        wall_clock: Clock = time.time,
        timer: Timer | None = None,
    ) -> None:
        self.config = config
        self.timing = config.timing
        self.clock = clock
        self.sleep = sleep
        self.wall_clock = wall_clock
        self.backend_id = config.backend_id
        self.kv = make_kv_cache(config)
        timer = timer or LoopTimer()
        self.scheduler = DecodeScheduler(config.timing, timer)
        self.steps: StepScheduler | None = None
        if config.timing.batching == "vllm":
            self.steps = StepScheduler(
                config.timing, config.max_concurrent_requests, config.max_waiting_requests, timer
            )
        # In vllm mode the step scheduler admits generating requests; slots only count embeddings.
        slot_limit = 0 if self.steps is not None else config.max_concurrent_requests
        self.slots = Slots(slot_limit, config.max_waiting_requests)
        pausable = self.steps if self.steps is not None else self.scheduler
        self.control = TestControl(config.model, on_pause=pausable.pause, on_resume=pausable.resume)
        self.stats = StatsHub(config.model, config.max_concurrent_requests, self.control.limit_overrides)
        self.log = RequestLog(config.request_log, config.backend_id) if config.request_log else None
        self.arrivals = ArrivalLog(config.arrival_log, config.backend_id) if config.arrival_log else None
        continuous = config.timing.batching == "continuous" and config.timing.prefill_enabled
        self._pool = PrefillPool(config.timing.prefill_tokens_per_s) if continuous else None
        self._prefilling = 0
        self._prefill_tokens = 0
        self.prompt_tokens_total = 0  # prompt tokens of requests whose prefill completed
        self.requests_completed = 0  # requests that ended with their whole answer
        self._wall_offset = wall_clock() - clock()

    @property
    def decoding(self) -> int:
        return self.steps.decoding if self.steps is not None else self.scheduler.decoding

    @property
    def generated_tokens_total(self) -> int:
        """Tokens emitted so far, those of requests still decoding included."""
        steps = self.steps.tokens_total if self.steps is not None else 0
        return self.scheduler.tokens_total + steps

    @property
    def running(self) -> int:
        """Requests the engine is working on (holding a slot; vllm: admitted sequences)."""
        steps = self.steps.running if self.steps is not None else 0
        return self.slots.running + steps

    @property
    def waiting(self) -> int:
        """Requests queued for admission."""
        return self.steps.waiting if self.steps is not None else self.slots.waiting

    @property
    def prefill_tokens_pending(self) -> int:
        """Uncached prompt tokens of admitted requests not yet prefilled."""
        return self.steps.prefill_tokens_pending if self.steps is not None else self._prefill_tokens

    @property
    def prefilling(self) -> int:
        """Requests computing their prompt right now."""
        return self.steps.prefilling if self.steps is not None else self._prefilling

    async def enter(
        self, admit: Callable[[], int], *, immediate: bool, scheduled: Callable[[int], None] | None = None
    ) -> Seat:
        """Queue for a seat; raises :class:`QueueFull`. ``immediate``: no first-token delay;
        ``scheduled``: vllm mode's per-chunk callback (:class:`StepScheduler`)."""
        if self.steps is not None:
            return self.steps.submit(admit, immediate, scheduled)
        await self.slots.acquire()
        return SlotSeat(admit)

    async def prefill_seat(self, seat: Seat) -> None:
        """Wait for admission and prefill (the seat's ``admit`` runs on admission)."""
        if isinstance(seat, Sequence):
            await seat.prefilled
        else:
            await self.prefill(seat.admit())

    def start_decode(self, seat: Seat, decode: Decode) -> None:
        if isinstance(seat, Sequence):
            assert self.steps is not None
            self.steps.start(seat, decode)
        else:
            self.scheduler.start(decode)

    def stop_decode(self, seat: Seat, decode: Decode) -> None:
        if isinstance(seat, Sequence):
            assert self.steps is not None
            self.steps.cancel(seat, decode)
        else:
            self.scheduler.cancel(decode)

    def leave(self, seat: Seat) -> None:
        if isinstance(seat, Sequence):
            assert self.steps is not None
            self.steps.release(seat)
        else:
            self.slots.release()

    def to_wall(self, monotonic: float) -> float:
        return monotonic + self._wall_offset

    async def prefill(self, uncached_tokens: int) -> None:
        """Spend the prefill time of ``uncached_tokens`` under the configured batching mode."""
        if uncached_tokens <= 0 or not self.timing.prefill_enabled:
            return
        self._prefilling += 1
        self._prefill_tokens += uncached_tokens
        try:
            if self._pool is not None:
                await self._pool.run(uncached_tokens)
            else:
                await self.sleep(prefill_seconds(uncached_tokens, self.timing.prefill_tokens_per_s))
        finally:
            self._prefilling -= 1
            self._prefill_tokens -= uncached_tokens

    async def sleep_until(self, deadline: float) -> None:
        delay = deadline - self.clock()
        if delay > 0:
            await self.sleep(delay)
