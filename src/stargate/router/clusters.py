"""One routed cluster of one target: members, aggregated snapshot (spec §1.8) and reservations (§1.9).

A ``ClusterState`` is mutated only by ``RoutingState`` (synchronously, on the event loop). The
immutable ``Candidate`` that readers share is built at the first read after a change. Reservations
added between heartbeats are folded onto the current stats one at a time; removing one applies the
remaining ones to the published aggregate at once, which gives the same result as applying them one
by one (``with_reservations``).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Set
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from stargate.balancer import with_reservation, with_reservations
from stargate.balancer.estimates import SlotMeter
from stargate.balancer.types import NO_IN_FLIGHT, Candidate, InFlight, ModelStats, Target, valid_tps
from stargate.wire.limits import MAX_PLAUSIBLE_TOKENS, MAX_PLAUSIBLE_TPS, sat_u64
from stargate.wire.proto import CACHED_PROMPT_WORK

MAX_RESERVATIONS_PER_CLUSTER = 65_536
"""Reservations normally end within one heartbeat; the cap only guards against a silent backend."""


@dataclass(frozen=True, slots=True)
class Backend:
    """One admitted registration, as the proxy sees it."""

    inference_server_id: str
    url: str
    cluster_id: str


@dataclass(eq=False, slots=True)
class Reservation:
    """One proxy attempt on one cluster, from dispatch until it ends; compared by identity.

    It carries two things: the spec's optimistic load (§1.9), pending until the backend's next
    heartbeat counts it, and the router's own in-flight record, kept until the attempt ends.

    ``prefill_tokens`` is the prefill work the attempt brings: its input tokens, or less when the
    decision expected its prefix cached (load-aware affinity picks). Queued-input work is counted
    with it; a heartbeat that counts the whole prompt is credited the difference while the attempt
    prefills (not one from a Pylon that publishes ``CACHED_PROMPT_WORK``: it left the cache out).
    The spec's checks count what that Pylon counts (``pylon_tokens``).
    """

    target: Target
    cluster_id: str
    backend_id: str
    input_tokens: int
    priority: int
    prefill_tokens: int
    key: str | None = None  # the request's cache-affinity key
    prefilling: bool = True
    counted: bool = False  # running when its backend last published: part of that heartbeat's counts
    counted_prefilling: bool = False  # ... and still waiting for its first byte then
    slot_since: float | None = None  # dispatched to a free slot at this clock time (None: no free slot)
    cached_work: bool = False  # its backend publishes CACHED_PROMPT_WORK (set when the cluster takes it)
    ran: bool = True  # False once its answer is a refusal (not 2xx): it measures no rate or slot hold

    @property
    def pylon_tokens(self) -> int:
        """The prompt work its backend's Pylon counts: the whole prompt, unless it leaves cached
        prefixes out as the router does."""
        return self.prefill_tokens if self.cached_work else self.input_tokens


@dataclass(slots=True)
class Departures:
    """What left a backend since its last heartbeat that the heartbeat still counts."""

    requests: int = 0
    waiting: int = 0
    waiting_tokens: int = 0
    tokens: int = 0
    prefilled_keys: set[str] = field(default_factory=set)  # keys of this router's that left prefill

    def adjust(self, stats: ModelStats) -> ModelStats:
        return replace(
            stats,
            num_running_queries=max(0, stats.num_running_queries - self.requests),
            queue_size=max(0, stats.queue_size - self.waiting),
            queued_input_size=max(0, stats.queued_input_size - self.waiting_tokens),
            total_query_input_size=max(0, stats.total_query_input_size - self.tokens),
            prefilling_cache_affinity_keys=stats.prefilling_cache_affinity_keys - self.prefilled_keys,
        )

    def left_prefill(self, reservation: Reservation) -> None:
        """A request the heartbeat counted before its first byte has had it (or ended)."""
        self.waiting += 1
        self.waiting_tokens += reservation.prefill_tokens
        if reservation.key:
            self.prefilled_keys.add(reservation.key)


PREFILL_SAMPLE_S = 1.0
"""Busy time one prefill-rate sample spans: long enough to hold several first bytes."""
PREFILL_SAMPLES = 5
"""The measured rate is the lower median of this many latest samples (about the last five seconds of
prefill): one request that claimed an absurd prompt cannot move it, nor can one stalled second."""


@dataclass(slots=True)
class PrefillMeter:
    """A cluster's prefill rate as this router sees it, from the requests it sent expecting their
    whole prompt prefilled (no cached prefix): their prompt tokens that reached their first byte,
    per second during which at least one of them was prefilling there. Requests side by side share
    the time, so this is the engine's rate rather than one request's share of it (Pylon's
    per-request samples are the latter). Requests expected to hit a cache are left out: counting
    their expected work, an engine that served more hits than expected measured faster than it is,
    drew more requests and measured faster still. It reads low while other work shares the engine
    (requests with cached prefixes, other routers' requests); ``estimates.load_tps`` takes it only
    above the published rate. Claims beyond ``MAX_PLAUSIBLE_TOKENS`` and samples beyond
    ``MAX_PLAUSIBLE_TPS`` are not counted, as in Pylon.
    """

    rate: float = 0.0
    tokens: int = 0
    busy_s: float = 0.0
    busy_since: float | None = None
    prefilling: int = 0
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=PREFILL_SAMPLES))

    def started(self, now: float) -> None:
        """A measured request started prefilling."""
        self.prefilling += 1
        if self.prefilling == 1:
            self.busy_since = now

    def ended(self, now: float) -> None:
        """A measured request reached its first byte (after ``prefilled``) or ended before it."""
        self.prefilling -= 1
        if self.prefilling == 0 and self.busy_since is not None:
            self.busy_s += max(0.0, now - self.busy_since)
            self.busy_since = None

    def prefilled(self, tokens: int, now: float) -> None:
        """A measured request reached its first byte."""
        if tokens <= MAX_PLAUSIBLE_TOKENS:
            self.tokens += tokens
        if self.busy_since is not None:
            self.busy_s += max(0.0, now - self.busy_since)
            self.busy_since = now
        busy = self.busy_s
        if busy < PREFILL_SAMPLE_S or self.tokens <= 0:
            return
        sample = self.tokens / busy
        self.tokens, self.busy_s = 0, 0.0
        if sample <= MAX_PLAUSIBLE_TPS:
            self.samples.append(sample)
            self.rate = statistics.median_low(self.samples)


def _add(counts: dict[str, int], key: str, change: int) -> int:
    """Change ``key``'s count, dropping it at zero (the maps hold only what is in flight)."""
    count = counts.get(key, 0) + change
    if count > 0:
        counts[key] = count
    else:
        counts.pop(key, None)
    return count


def _with_size(sizes: tuple[int, ...], size: int, change: int) -> tuple[int, ...]:
    """``sizes`` (ascending) with one ``size`` added (+1) or removed (-1)."""
    at = bisect.bisect_left(sizes, size)
    if change > 0:
        return (*sizes[:at], size, *sizes[at:])
    return (*sizes[:at], *sizes[at + 1 :]) if at < len(sizes) and sizes[at] == size else sizes


def _measured(reservation: Reservation) -> bool:
    """The prefill meter's requests: a prompt the decision expected prefilled whole."""
    return 0 < reservation.input_tokens == reservation.prefill_tokens


@dataclass(frozen=True, slots=True)
class Member:
    """A backend's latest active publication for one target."""

    backend: Backend
    stats: ModelStats
    rtt_ns: int
    updated_at: float
    generation: int


class RoundRobin:
    """Backend counter of one (target, cluster), shared by every request of the target."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next = 0


@dataclass(frozen=True, slots=True)
class BackendPicker:
    """The sorted members of a cluster at snapshot time, plus the shared counter (§1.11)."""

    backends: tuple[Backend, ...]
    counter: RoundRobin

    def pick(self, failed_backend_ids: Set[str]) -> Backend | None:
        backends = self.backends
        if failed_backend_ids:
            backends = tuple(b for b in backends if b.inference_server_id not in failed_backend_ids)
        eligible = backends
        if not eligible:
            return None
        index = self.counter.next
        self.counter.next = index + 1
        return eligible[index % len(eligible)]


def aggregate(members: list[Member], source: Member) -> ModelStats:
    """Cluster stats from its active members (sorted by id) and the latest-wins source backend."""
    tps = 0.0
    output_tps = 0.0
    queue_size = queued = processing = generating = observed = 0
    capabilities: dict[str, None] = {}
    sources: dict[str, None] = {}
    prefilling: frozenset[str] = frozenset()
    for member in members:
        stats = member.stats
        if keys := stats.prefilling_cache_affinity_keys:
            prefilling = prefilling | keys if prefilling else keys
        if valid_tps(stats.last_mean_input_tps):
            tps += stats.last_mean_input_tps
        output_tps += stats.output_tps
        queue_size += stats.queue_size
        queued += stats.queued_input_size
        processing += stats.input_processing_queries
        generating += stats.output_generation_queries
        observed = max(observed, stats.stats_observed_at_unix_ms)
        capabilities.update(dict.fromkeys(stats.stats_capabilities))
        sources.update(dict.fromkeys(stats.stats_sources))
    return replace(
        source.stats,
        last_mean_input_tps=tps,
        output_tps=output_tps,
        queue_size=sat_u64(queue_size),
        queued_input_size=sat_u64(queued),
        input_processing_queries=sat_u64(processing),
        output_generation_queries=sat_u64(generating),
        stats_observed_at_unix_ms=observed,
        stats_capabilities=tuple(capabilities),
        stats_sources=tuple(sources),
        prefilling_cache_affinity_keys=prefilling,
    )


class ClusterState:
    """Members of one ``(routing_key, cluster_id)`` inside one target, bound to a cluster generation."""

    __slots__ = (
        "_base",
        "_candidate",
        "_clock",
        "_counter",
        "_departed",
        "_in_flight",
        "_keys",
        "_keys_view",
        "_meter",
        "_prefilling_keys",
        "_pylon_stats",
        "_slots",
        "_stats",
        "cluster_id",
        "generation",
        "members",
        "picker",
        "reservations",
        "running",
        "source_id",
    )

    def __init__(self, cluster_id: str, generation: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster_id = cluster_id
        self.generation = generation
        self._clock = clock
        self._meter = PrefillMeter()
        self._slots = SlotMeter()
        self.members: dict[str, Member] = {}
        self.reservations: OrderedDict[Reservation, None] = OrderedDict()  # oldest first
        self.running: OrderedDict[Reservation, None] = OrderedDict()
        self._departed: dict[str, Departures] = {}
        self._in_flight = NO_IN_FLIGHT
        self._prefilling_keys: dict[str, int] = {}
        self._keys: dict[str, int] = {}
        self._keys_view = MappingProxyType(self._keys)
        self.source_id: str | None = None
        self._counter = RoundRobin()
        self._base = Candidate(cluster_id=cluster_id, stats=ModelStats(), rtt_s=0.0, active_backend_count=0)
        self._stats = self._base.stats
        self._pylon_stats: ModelStats | None = None  # ``Candidate.pylon_stats``
        self._candidate: Candidate | None = self._base
        self.picker = BackendPicker((), self._counter)

    @property
    def candidate(self) -> Candidate:
        """The published aggregate with pending reservations and the in-flight count; built when a
        decision reads it after a change, not on every change (a request changes it several times)."""
        candidate = self._candidate
        if candidate is None:
            base = self._base
            candidate = Candidate(
                cluster_id=self.cluster_id,
                stats=self._stats,
                rtt_s=base.rtt_s,
                updated_at=base.updated_at,
                active_backend_count=base.active_backend_count,
                in_flight=self._in_flight,
                measured_input_tps=self._meter.rate,
                measured_slot_s=self._slots.mean_s,
                slot_held_since=self._slot_held_since(),
                pylon_stats=self._pylon_stats,
            )
            self._candidate = candidate
        return candidate

    def _slot_held_since(self) -> float:
        """Until a request has ended here, when the oldest running one took its slot (``running``
        is in dispatch order: the scan stops at the first that found a slot free)."""
        if self._slots.mean_s > 0.0:
            return math.inf
        for attempt in self.running:
            if attempt.slot_since is not None:
                return attempt.slot_since
        return math.inf

    def has_in_flight(self, key: str) -> bool:
        """This router has a request of ``key`` in flight here."""
        return key in self._keys

    def upsert(self, member: Member) -> None:
        """The member just published: it becomes the source and its own reservations end.

        Its stats count what ran there when it published; this router's attempts running there now
        are marked counted, so that when they end (or reach their first byte) before the next
        heartbeat the stale counts shrink with them (``Departures``) instead of lagging a period.
        """
        backend_id = member.backend.inference_server_id
        joined = backend_id not in self.members
        self.members[backend_id] = member
        self.source_id = backend_id
        self._drop_reservations_of(backend_id)
        self._departed.pop(backend_id, None)
        cached = 0
        counted_whole = CACHED_PROMPT_WORK not in member.stats.stats_capabilities
        for attempt in self.running:
            if attempt.backend_id == backend_id:
                attempt.counted = True
                attempt.counted_prefilling = attempt.prefilling
                if attempt.prefilling and counted_whole:
                    cached += attempt.input_tokens - attempt.prefill_tokens
        if cached:
            self._departed[backend_id] = Departures(waiting_tokens=cached)
        self._recompute(membership_changed=joined)

    def remove(self, backend_id: str) -> bool:
        if self.members.pop(backend_id, None) is None:
            return False
        if self.source_id == backend_id:
            self.source_id = None
        self._drop_reservations_of(backend_id)
        self._forget_running_of(backend_id)
        self._departed.pop(backend_id, None)
        self._recompute(membership_changed=True)
        return True

    def add_reservation(self, reservation: Reservation) -> None:
        member = self.members.get(reservation.backend_id)
        reservation.cached_work = member is not None and CACHED_PROMPT_WORK in member.stats.stats_capabilities
        if len(self.reservations) >= MAX_RESERVATIONS_PER_CLUSTER:
            self.reservations.popitem(last=False)
            self.reservations[reservation] = None
            self._refold()
            return
        self.reservations[reservation] = None
        stats, whole, priority = self._stats, reservation.pylon_tokens, reservation.priority
        if self._pylon_stats is not None or whole != reservation.prefill_tokens:
            counted = stats if self._pylon_stats is None else self._pylon_stats
            self._pylon_stats = with_reservation(counted, whole, priority)
        self._stats = with_reservation(stats, reservation.prefill_tokens, priority)
        self._candidate = None

    def release(self, reservation: Reservation) -> bool:
        if reservation not in self.reservations:
            return False
        del self.reservations[reservation]
        self._refold()
        return True

    def start(self, reservation: Reservation) -> None:
        """Count a dispatched attempt in flight (prefilling) until ``finish``."""
        if len(self.running) >= MAX_RESERVATIONS_PER_CLUSTER:
            self._end(next(iter(self.running)))  # OrderedDict: its oldest in O(1)
        limit = self._stats.max_engine_concurrency
        # The stats count this attempt's reservation already; the in-flight count does not yet.
        running = max(self._stats.num_running_queries - 1, self._in_flight.requests)
        if limit > 0 and running < limit:
            reservation.slot_since = self._clock()
        self.running[reservation] = None
        if reservation.key:
            _add(self._keys, reservation.key, +1)
        self._count(reservation, +1)

    def first_byte(self, reservation: Reservation) -> bool:
        """The attempt's first response byte arrived: its prefill is over, it is decoding now."""
        if reservation not in self.running or not reservation.prefilling:
            return False
        if _measured(reservation) and reservation.ran:
            self._meter.prefilled(reservation.input_tokens, self._clock())
        self._count(reservation, -1)
        reservation.prefilling = False
        self._count(reservation, +1)
        if reservation.counted and reservation.counted_prefilling:
            reservation.counted_prefilling = False
            departed = self._departed.setdefault(reservation.backend_id, Departures())
            departed.left_prefill(reservation)  # the rest of its tokens was credited already
            self._recompute(membership_changed=False)
        return True

    def finish(self, reservation: Reservation) -> bool:
        """The attempt ended: it leaves the in-flight count, and its reservation if still pending."""
        changed = self._end(reservation)
        if reservation in self.reservations:
            del self.reservations[reservation]
            self._refold()
            changed = True
        return changed

    def _end(self, reservation: Reservation) -> bool:
        if reservation not in self.running:
            return False
        del self.running[reservation]
        if reservation.key:
            _add(self._keys, reservation.key, -1)
        self._count(reservation, -1)
        if reservation.slot_since is not None and not reservation.prefilling and reservation.ran:
            self._slots.ended(max(0.0, self._clock() - reservation.slot_since))
        if reservation.counted and reservation.backend_id in self.members:
            reservation.counted = False
            departed = self._departed.setdefault(reservation.backend_id, Departures())
            departed.requests += 1
            departed.tokens += reservation.input_tokens
            if reservation.counted_prefilling:
                departed.left_prefill(reservation)
            self._recompute(membership_changed=False)
        return True

    def _count(self, reservation: Reservation, sign: int) -> None:
        """Add (+1) or remove (-1) one attempt, in its current phase, from the in-flight count."""
        current = self._in_flight
        prefill = sign if reservation.prefilling else 0
        keys = current.prefilling_keys
        key = reservation.key
        if prefill and key:
            counts = self._prefilling_keys
            if (_add(counts, key, prefill) > 0) != (key in keys):
                keys = frozenset(counts)
        sizes = current.prefill_sizes
        if prefill:
            sizes = _with_size(sizes, reservation.prefill_tokens, prefill)
        self._in_flight = InFlight(
            current.requests + sign,
            current.prefilling + prefill,
            current.prefill_tokens + prefill * reservation.prefill_tokens,
            keys,
            self._keys_view,
            sizes,
            current.cached_tokens + prefill * (reservation.pylon_tokens - reservation.prefill_tokens),
        )
        if prefill and _measured(reservation):
            if prefill > 0:
                self._meter.started(self._clock())
            else:
                self._meter.ended(self._clock())
        self._candidate = None

    def _drop_reservations_of(self, backend_id: str) -> None:
        if self.reservations:
            kept = (r for r in self.reservations if r.backend_id != backend_id)
            self.reservations = OrderedDict.fromkeys(kept)

    def _forget_running_of(self, backend_id: str) -> None:
        """A backend that left takes its in-flight attempts with it: they are no load of the cluster."""
        for reservation in [r for r in self.running if r.backend_id == backend_id]:
            self._end(reservation)

    def _recompute(self, *, membership_changed: bool) -> None:
        ordered = [self.members[k] for k in sorted(self.members)]
        if membership_changed:
            self.picker = BackendPicker(tuple(m.backend for m in ordered), self._counter)
        if not ordered:
            self._base = replace(self._base, active_backend_count=0)
            self._stats = self._base.stats
            self._pylon_stats = None
            self._candidate = None
            return
        if self.source_id is None:
            self.source_id = max(ordered, key=lambda m: m.updated_at).backend.inference_server_id
        if self._departed:
            ordered = [self._net(m) for m in ordered]
            source = next(m for m in ordered if m.backend.inference_server_id == self.source_id)
        else:
            source = self.members[self.source_id]
        rtt_ns = sum(m.rtt_ns for m in ordered) // len(ordered)
        self._base = Candidate(
            cluster_id=self.cluster_id,
            stats=aggregate(ordered, source),
            rtt_s=rtt_ns / 1e9,
            updated_at=source.updated_at,
            active_backend_count=len(ordered),
        )
        self._refold()

    def _net(self, member: Member) -> Member:
        departed = self._departed.get(member.backend.inference_server_id)
        return member if departed is None else replace(member, stats=departed.adjust(member.stats))

    def _refold(self) -> None:
        """Fold the pending reservations onto the published aggregate; a second view, as Pylon
        counts them, only while one of them is expected partly cached."""
        reservations, base = self.reservations, self._base.stats
        self._stats = with_reservations(base, [(r.prefill_tokens, r.priority) for r in reservations])
        self._pylon_stats = None
        if any(r.pylon_tokens != r.prefill_tokens for r in reservations):
            self._pylon_stats = with_reservations(base, [(r.pylon_tokens, r.priority) for r in reservations])
        self._candidate = None
