"""One routed cluster of one target: members, aggregated snapshot (spec §1.8) and reservations (§1.9).

A ``ClusterState`` is mutated only by ``RoutingState`` (synchronously, on the event loop). After each
mutation it holds a fresh immutable ``Candidate`` that readers share; nothing is recomputed per
request. Reservations added between heartbeats are folded onto the current candidate one at a
time; removing one re-folds the remaining ones onto the published aggregate, which gives the same
result as applying them all in insertion order.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, replace

from stargate.balancer import with_reservation
from stargate.balancer.types import Candidate, ModelStats, Target, valid_tps
from stargate.wire.limits import sat_u64

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
    """Optimistic load of one proxy attempt on one cluster; compared by identity."""

    target: Target
    cluster_id: str
    backend_id: str
    input_tokens: int
    priority: int


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
    for member in members:
        stats = member.stats
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
    )


class ClusterState:
    """Members of one ``(routing_key, cluster_id)`` inside one target, bound to a cluster generation."""

    __slots__ = (
        "_base",
        "_counter",
        "candidate",
        "cluster_id",
        "generation",
        "members",
        "picker",
        "reservations",
        "source_id",
    )

    def __init__(self, cluster_id: str, generation: int) -> None:
        self.cluster_id = cluster_id
        self.generation = generation
        self.members: dict[str, Member] = {}
        self.reservations: dict[Reservation, None] = {}
        self.source_id: str | None = None
        self._counter = RoundRobin()
        self._base = Candidate(cluster_id=cluster_id, stats=ModelStats(), rtt_s=0.0, active_backend_count=0)
        self.candidate = self._base
        self.picker = BackendPicker((), self._counter)

    def upsert(self, member: Member) -> None:
        """The member just published: it becomes the source and its own reservations end."""
        backend_id = member.backend.inference_server_id
        joined = backend_id not in self.members
        self.members[backend_id] = member
        self.source_id = backend_id
        self._drop_reservations_of(backend_id)
        self._recompute(membership_changed=joined)

    def remove(self, backend_id: str) -> bool:
        if self.members.pop(backend_id, None) is None:
            return False
        if self.source_id == backend_id:
            self.source_id = None
        self._drop_reservations_of(backend_id)
        self._recompute(membership_changed=True)
        return True

    def add_reservation(self, reservation: Reservation) -> None:
        if len(self.reservations) >= MAX_RESERVATIONS_PER_CLUSTER:
            del self.reservations[next(iter(self.reservations))]
            self.reservations[reservation] = None
            self._refold()
            return
        self.reservations[reservation] = None
        stats = with_reservation(self.candidate.stats, reservation.input_tokens, reservation.priority)
        self.candidate = replace(self.candidate, stats=stats)

    def release(self, reservation: Reservation) -> bool:
        if reservation not in self.reservations:
            return False
        del self.reservations[reservation]
        self._refold()
        return True

    def _drop_reservations_of(self, backend_id: str) -> None:
        if self.reservations:
            self.reservations = {r: None for r in self.reservations if r.backend_id != backend_id}

    def _recompute(self, *, membership_changed: bool) -> None:
        ordered = [self.members[k] for k in sorted(self.members)]
        if membership_changed:
            self.picker = BackendPicker(tuple(m.backend for m in ordered), self._counter)
        if not ordered:
            self._base = replace(self._base, active_backend_count=0)
            self.candidate = self._base
            return
        if self.source_id is None:
            self.source_id = max(ordered, key=lambda m: m.updated_at).backend.inference_server_id
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

    def _refold(self) -> None:
        stats = self._base.stats
        for reservation in self.reservations:
            stats = with_reservation(stats, reservation.input_tokens, reservation.priority)
        self.candidate = self._base if stats is self._base.stats else replace(self._base, stats=stats)
