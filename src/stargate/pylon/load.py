"""Live load of proxied requests per model generation (spec pylon.md §6.5).

Phases only move forward: pending → input_processing → output_generation. Prompt work is kept
per *effective* priority: a pending request counts at its own priority, an input-processing
request at priority 0 (it already delays every class), later phases and zero-token requests
count nothing. Every update is O(1); estimates cost O(distinct priorities).

A request's prompt work is its input tokens (the spec), or with ``prefix_caching`` (not in the
original; ``--engine-prefix-caching``) what the engine's prefix cache does not cover: a
conversation re-sends its history under one cache-affinity key, so a longer prompt of a key whose
last prompt was sent to this engine only adds its growth. That holds from when the earlier prompt
is sent, not from when its prefill ends: an engine schedules a turn queued behind its predecessor
after that prefix is cached. Without this a replica serving long conversations looks loaded with
work it will never do, and routers move conversations away from their cache.

The keys of the requests before their first byte are published too (not in the original): a router
holds another request of such a key for that prefill, whichever router sent the first.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TypeVar

from stargate.balancer.estimates import SlotMeter
from stargate.balancer.types import valid_tps
from stargate.pylon.models import Generation
from stargate.wire.limits import U64_MAX, remember_newest, remembered, sat_u64
from stargate.wire.proto import MAX_AFFINITY_KEY_CHARS, MAX_AFFINITY_ROUTES

_K = TypeVar("_K")

PROMPT_MEMORY = 65_536
"""Cache-affinity keys whose last sent prompt is remembered; the least recently used goes."""


class Phase(IntEnum):
    PENDING = 0
    INPUT_PROCESSING = 1
    OUTPUT_GENERATION = 2


@dataclass(slots=True)
class _Tracked:
    generation: Generation
    phase: Phase
    priority: int
    input_tokens: int
    work_tokens: int  # the prompt work the engine still has to do (input tokens minus its cache)
    key: str | None = None
    slot_since: float | None = None  # sent to the engine with a slot free: its hold is measured
    sent_at: float | None = None  # when it went to the engine

    @property
    def work_priority(self) -> int | None:
        if self.work_tokens == 0 or self.phase is Phase.OUTPUT_GENERATION:
            return None
        return self.priority if self.phase is Phase.PENDING else 0


@dataclass(slots=True)
class _GenerationLoad:
    phase_counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    phase_input: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_input: int = 0
    work_by_priority: dict[int, int] = field(default_factory=dict)
    prefilling_keys: dict[str, int] = field(default_factory=dict)  # key -> requests before first byte
    slots: SlotMeter = field(default_factory=SlotMeter)
    own: int = 0  # slots held by Pylon's own requests (canaries): admission counts them, stats do not

    def add(self, t: _Tracked, sign: int) -> None:
        self.phase_counts[t.phase] += sign
        self.phase_input[t.phase] += sign * t.input_tokens
        self.total_input += sign * t.input_tokens
        key = t.key
        if key and t.phase != Phase.OUTPUT_GENERATION and len(key) <= MAX_AFFINITY_KEY_CHARS:
            _change(self.prefilling_keys, key, sign)
        p = t.work_priority
        if p is not None:
            _change(self.work_by_priority, p, sign * t.work_tokens)


def _change(amounts: dict[_K, int], key: _K, delta: int) -> None:
    """Add ``delta`` to ``key``'s amount, dropping the key at zero: the maps hold only what is in
    flight."""
    amount = amounts.get(key, 0) + delta
    if amount > 0:
        amounts[key] = amount
    else:
        amounts.pop(key, None)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    queue_size: int = 0
    input_processing_queries: int = 0
    output_generation_queries: int = 0
    num_running_queries: int = 0
    total_query_input_size: int = 0
    queued_input_size: int = 0
    prefilling_keys: frozenset[str] = frozenset()
    """Cache-affinity keys of the requests before their first byte (at most ``MAX_AFFINITY_ROUTES``)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engine reports of its own load (Prometheus source): requests holding a slot and
    requests waiting for one."""

    running: int
    waiting: int

    def beyond(self, own: LoadSnapshot, canaries: int = 0) -> EngineExcess:
        """What the engine holds beyond Pylon's own requests, read against Pylon's count at the
        poll: a request Pylon relays is also on the engine, so adding them would count it twice.
        ``canaries``: Pylon's own requests that its published load leaves out, on the engine too."""
        return EngineExcess(
            queued=max(0, self.waiting - own.queue_size - canaries),
            held=max(0, sat_u64(self.running + self.waiting) - own.num_running_queries - canaries),
        )


@dataclass(frozen=True, slots=True)
class EngineExcess:
    """Requests on the engine that Pylon did not send (another client of the engine), as of the
    last poll. Added to Pylon's own exact count as it stands now: the engine's total, up to a poll
    old, kept a 2 x 8 fleet full with 14 requests in flight, its ended requests still counted."""

    queued: int
    held: int

    def add_to(self, own: LoadSnapshot) -> LoadSnapshot:
        return replace(
            own,
            queue_size=sat_u64(own.queue_size + self.queued),
            num_running_queries=sat_u64(own.num_running_queries + self.held),
        )


def estimate_ms(tokens: int, tps: float) -> int:
    """``ceil(tokens / tps · 1000)`` saturating at u64 max; ``tps`` must be valid."""
    value = math.ceil(tokens / tps * 1000.0) if tokens else 0
    return min(value, U64_MAX) if math.isfinite(value) else U64_MAX


def _unchanged(_generation: Generation) -> None:
    return None


class LiveLoad:
    """Request id → tracked request, plus incremental per-generation aggregates.

    ``on_change(generation)`` runs after every change of a generation's counts (set once at
    startup), so the change can be published without waiting for the next heartbeat.
    """

    def __init__(self, *, prefix_caching: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, _Tracked] = {}
        self._generations: dict[Generation, _GenerationLoad] = {}
        self._prefix_caching = prefix_caching
        self._prompts: OrderedDict[tuple[Generation, str], int] = OrderedDict()  # key → last prompt's tokens
        self.on_change: Callable[[Generation], None] = _unchanged
        self._duplicates = itertools.count(2)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def prefix_caching(self) -> bool:
        return self._prefix_caching

    def unique_key(self, request_id: str) -> str:
        """The key to track a new request by: ``request_id``, or ``request_id#N`` while one with
        that id is tracked. A client may send one id on several requests at once; keyed by the id
        alone they counted as one, and the first to end released them all."""
        if request_id not in self._requests:
            return request_id
        return f"{request_id}#{next(self._duplicates)}"

    def track(
        self,
        request_id: str,
        generation: Generation,
        priority: int,
        input_tokens: int,
        key: str | None = None,
    ) -> None:
        """Start tracking as pending; a re-tracked id moves its load entirely to ``generation``.
        ``key`` is the request's cache-affinity key (used with ``prefix_caching``)."""
        self.release(request_id)
        work = input_tokens
        if self._prefix_caching and key:
            cached = self._prompts.get((generation, remembered(key)), 0)
            if cached <= input_tokens:  # a shorter prompt is another thread: its cache is unknown
                work -= cached
        t = _Tracked(generation, Phase.PENDING, priority, input_tokens, work, key)
        self._requests[request_id] = t
        self._generations.setdefault(generation, _GenerationLoad()).add(t, 1)
        self.on_change(generation)

    def advance(self, request_id: str, phase: Phase) -> None:
        t = self._requests.get(request_id)
        if t is None or phase <= t.phase:
            return
        agg = self._generations[t.generation]
        agg.add(t, -1)
        t.phase = phase
        agg.add(t, 1)
        self.on_change(t.generation)

    def sent(self, request_id: str, limit: int = 0) -> None:
        """The request goes to the engine now (admitted): its wait for output starts
        (``oldest_wait_s``). Sent while one of the engine's ``limit`` slots was free, its time there
        is measured (``slot_hold_s``). With ``prefix_caching`` its prompt is the key's cached prefix
        for the key's next prompt here (most recently used last). Keys too long to publish are not
        kept: the memory stays bounded in bytes."""
        t = self._requests.get(request_id)
        if t is None:
            return
        t.sent_at = self._clock()
        if limit > 0 and self.active_requests(t.generation, exclude_request_id=request_id) < limit:
            t.slot_since = t.sent_at
        if not self._prefix_caching or not t.key or len(t.key) > MAX_AFFINITY_KEY_CHARS:
            return
        # A long key by its digest, as the router keeps it.
        remember_newest(self._prompts, (t.generation, remembered(t.key)), t.input_tokens, PROMPT_MEMORY)

    def release(self, request_id: str) -> None:
        t = self._requests.pop(request_id, None)
        if t is not None:
            agg = self._generations[t.generation]
            agg.add(t, -1)
            if t.slot_since is not None and t.phase is Phase.OUTPUT_GENERATION:
                agg.slots.ended(max(0.0, self._clock() - t.slot_since))
            self.on_change(t.generation)

    def slot_hold_s(self, generation: Generation) -> float:
        """How long a request holds one of the engine's slots (``estimates.slot_hold_s``, as the
        router measures it): the mean of the latest answered requests, or before any ended, how
        long the oldest still running has held one; 0 when nothing is known."""
        agg = self._generations.get(generation)
        if agg is not None and agg.slots.mean_s > 0.0:
            return agg.slots.mean_s
        since = [t.slot_since for t in self._requests.values() if t.generation == generation]
        oldest = min((at for at in since if at is not None), default=None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest)

    def oldest_wait_s(self, generation: Generation) -> float | None:
        """How long the oldest request sent to the engine for ``generation`` and still without
        output (queued or prefilling) has waited, None when there is none: an engine prefilling a
        long prompt produces nothing, and a canary queued behind it is late, not failed. A scan of
        the requests in flight, read only for a late canary: no cost per request."""
        oldest = min(
            (
                t.sent_at
                for t in self._requests.values()
                if t.generation == generation
                and t.sent_at is not None
                and t.phase is not Phase.OUTPUT_GENERATION
            ),
            default=None,
        )
        return None if oldest is None else max(0.0, self._clock() - oldest)

    @contextlib.contextmanager
    def occupying(self, generation: Generation) -> Iterator[None]:
        """Count a request Pylon sends itself (a canary) as holding a slot while it runs, for
        admission only: a request sent for a free slot that finds it taken is refused and goes
        elsewhere. The published load leaves it out: a router that saw the slot taken answered a
        client without a routing wait 503 where the request could have waited for the canary."""
        agg = self._generations.setdefault(generation, _GenerationLoad())
        agg.own += 1
        try:
            yield
        finally:
            agg.own -= 1

    def own_requests(self, generation: Generation) -> int:
        """Requests Pylon sends itself (canaries) running for ``generation`` (``occupying``)."""
        agg = self._generations.get(generation)
        return agg.own if agg is not None else 0

    def generation_of(self, request_id: str) -> Generation | None:
        t = self._requests.get(request_id)
        return t.generation if t is not None else None

    def prefill_share(self, request_id: str) -> float:
        """The share of a tracked request's prompt counted as work: below 1 with ``prefix_caching``
        when the key's last prompt covers part of it (1 for an unknown request or an empty prompt)."""
        t = self._requests.get(request_id)
        if t is None or t.input_tokens <= 0:
            return 1.0
        return t.work_tokens / t.input_tokens

    def purge_generation(self, generation: Generation) -> None:
        for rid in [rid for rid, t in self._requests.items() if t.generation == generation]:
            del self._requests[rid]
        self._generations.pop(generation, None)
        for prompt in [prompt for prompt in self._prompts if prompt[0] == generation]:
            del self._prompts[prompt]

    def snapshot(self, generation: Generation) -> LoadSnapshot:
        agg = self._generations.get(generation)
        if agg is None:
            return LoadSnapshot()
        pending, prefill, decode = agg.phase_counts
        return LoadSnapshot(
            queue_size=pending + prefill,
            input_processing_queries=prefill,
            output_generation_queries=decode,
            num_running_queries=pending + prefill + decode,
            total_query_input_size=sat_u64(agg.total_input),
            queued_input_size=sat_u64(sum(agg.work_by_priority.values())),
            prefilling_keys=frozenset(itertools.islice(agg.prefilling_keys, MAX_AFFINITY_ROUTES)),
        )

    def phase_totals(self) -> Iterator[tuple[Generation, list[int], list[int]]]:
        """Per generation: request counts and input tokens per phase (for scrape-time gauges)."""
        for generation, agg in self._generations.items():
            yield generation, list(agg.phase_counts), list(agg.phase_input)

    def has_generation(self, generation: Generation) -> bool:
        return generation in self._generations

    def estimates(
        self, generation: Generation, tps: float, *, exclude_request_id: str | None = None
    ) -> dict[int, int] | None:
        """Cumulative queue-time estimate per present priority key; None when the TPS is unknown.

        ``exclude_request_id`` removes that request's own prompt work (admission, §8.1 step 3).
        """
        if not valid_tps(tps):
            return None
        agg = self._generations.get(generation)
        if agg is None:
            return {}
        work = dict(agg.work_by_priority)
        own = self._requests.get(exclude_request_id) if exclude_request_id else None
        if own is not None and own.generation == generation and own.work_priority is not None:
            left = work.get(own.work_priority, 0) - own.work_tokens
            if left > 0:
                work[own.work_priority] = left
            else:
                work.pop(own.work_priority, None)
        out: dict[int, int] = {}
        cumulative = 0
        for p in sorted(work):
            cumulative += work[p]
            out[p] = estimate_ms(cumulative, tps)
        return out

    def active_requests(self, generation: Generation, *, exclude_request_id: str | None = None) -> int:
        """Requests holding or waiting for one of the engine's slots, Pylon's own included."""
        agg = self._generations.get(generation)
        active = sum(agg.phase_counts) + agg.own if agg is not None else 0
        own = self._requests.get(exclude_request_id) if exclude_request_id else None
        if own is not None and own.generation == generation:
            active -= 1
        return active
