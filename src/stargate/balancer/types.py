"""Immutable values the decision core works on: stats, candidates, requests and decisions.

Everything here is a frozen value: routing state builds new snapshots on every update and hands
the same objects to every request (no per-request copies). One exception, read-only:
``InFlight.keys`` views the router's live count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

EMPTY_PRIORITY_MAP: Mapping[int, int] = MappingProxyType({})
NO_KEYS: Mapping[str, int] = MappingProxyType({})


def _empty_priority_map() -> Mapping[int, int]:
    return EMPTY_PRIORITY_MAP


def valid_tps(value: float) -> bool:
    """A throughput is usable only when finite and positive."""
    return value > 0.0 and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class AffinityRoute:
    """A request of ``key`` that a backend admitted, whichever router sent it: its KV cache is there."""

    key: str
    input_tokens: int
    admitted_at_unix_ms: int


@dataclass(frozen=True, slots=True)
class ModelStats:
    """One backend's (or one cluster's aggregated) stats for one model; proto fields 1..18."""

    last_mean_input_tps: float = 0.0
    output_tps: float = 0.0
    queue_size: int = 0
    queued_input_size: int = 0
    max_output_tps: float = 0.0
    kv_cache_capacity_tokens: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_free_tokens: int = 0
    num_running_queries: int = 0
    max_engine_concurrency: int = 0
    total_query_input_size: int = 0
    queue_time_estimate_ms_by_priority: Mapping[int, int] = field(default_factory=_empty_priority_map)
    input_processing_queries: int = 0
    output_generation_queries: int = 0
    stats_observed_at_unix_ms: int = 0
    stats_capabilities: tuple[str, ...] = ()
    stats_sources: tuple[str, ...] = ()
    recent_cache_affinity_routes: tuple[AffinityRoute, ...] = ()
    """Not a load figure: what the backend admitted with a cache-affinity key in its last two
    heartbeat periods (``AffinityGroups.learn``)."""
    prefilling_cache_affinity_keys: frozenset[str] = frozenset()
    """Keys of the requests the backend is prefilling, whichever router sent them: their prefix is
    not cached there yet."""

    @property
    def has_kv_metrics(self) -> bool:
        return (
            self.kv_cache_capacity_tokens > 0
            or self.kv_cache_used_tokens > 0
            or self.kv_cache_free_tokens > 0
        )


@dataclass(frozen=True, slots=True)
class InFlight:
    """What this router has in flight to one cluster right now, exactly: it proxies every byte.

    A request is prefilling from dispatch until its first response body byte, then decoding until
    it ends. Published stats lag the engine by up to a heartbeat; this does not.
    """

    requests: int = 0
    prefilling: int = 0
    prefill_tokens: int = 0
    prefilling_keys: frozenset[str] = frozenset()
    """Cache-affinity keys of the requests still prefilling: their prefix is not cached there yet."""
    keys: Mapping[str, int] = field(default_factory=lambda: NO_KEYS)
    """Requests in flight there per cache-affinity key. A read-only view of the router's live count,
    for use within one decision: a copy per change would cost one per request start and end."""
    prefill_sizes: tuple[int, ...] = ()
    """Prefill tokens of each request still prefilling, ascending (their sum is ``prefill_tokens``):
    on an engine that shares its prefill rate, what a new prompt waits for depends on each size."""
    cached_tokens: int = 0
    """Prompt tokens of the requests still prefilling that the router expects cached (left out of
    ``prefill_tokens``) but their Pylon counts as work: one without ``CACHED_PROMPT_WORK`` counts
    whole prompts. What Pylon's admission compares with is ``prefill_tokens + cached_tokens``."""

    @property
    def decoding(self) -> int:
        return self.requests - self.prefilling


NO_IN_FLIGHT = InFlight()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routed cluster snapshot: what a load balancer chooses between (never a single backend).

    ``stats`` already includes pending routing reservations; ``in_flight`` is this router's own
    exact count, which the load-aware estimates merge with the stats.
    """

    cluster_id: str
    stats: ModelStats
    rtt_s: float
    updated_at: float = 0.0
    active_backend_count: int = 1
    in_flight: InFlight = NO_IN_FLIGHT
    measured_input_tps: float = 0.0
    """The cluster's prefill rate as this router measured it (0: not yet), from its requests expected
    to prefill their whole prompt (``router.clusters.PrefillMeter``)."""
    measured_slot_s: float = 0.0
    """How long this router's requests held an engine slot there, on average (0: none has ended
    yet; ``estimates.SlotMeter``): what a request waiting for a slot waits for, shared by the
    slots."""
    slot_held_since: float = math.inf
    """Until one has ended there (``measured_slot_s`` 0): when the oldest of this router's requests
    still holding a slot took it, on the requests' clock (inf: none). ``estimates.slot_hold_s``."""
    assumed_input_tps: float = 0.0
    """The prefill rate the load-aware estimates take for a cluster that publishes none (0: it
    publishes one); ``estimates.with_assumed_rates``."""
    pylon_stats: ModelStats | None = None
    """``stats`` with pending reservations counted as the cluster's Pylons count them (None: equal
    to ``stats``): whole prompts, where ``stats`` counts only what the router expects uncached."""

    @property
    def checked_stats(self) -> ModelStats:
        """What the spec's checks read (admission, the queue-SLO filter, the expected-queue header):
        Pylon compares the header with its own count, and the spec never scales queued work."""
        return self.stats if self.pylon_stats is None else self.pylon_stats


@dataclass(frozen=True, slots=True)
class Target:
    """Routing target: requests and registrations meet on ``(routing_key, model_id)``."""

    routing_key: str | None
    model_id: str


@dataclass(frozen=True, slots=True)
class LbRequest:
    """What a policy knows about one routing attempt. Times are seconds on one monotonic clock."""

    target: Target
    input_tokens: int
    received_at: float
    now: float
    priority: int = 0
    cache_affinity_key: str | None = None
    request_slo_ms: int | None = None
    excluded: frozenset[str] = frozenset()
    wait_deadline: float = math.inf
    """When routing must have decided: a policy's optional hold ends here (``x-max-wait-ms``)."""

    @property
    def elapsed_ms(self) -> float:
        return max(0.0, (self.now - self.received_at) * 1000.0)


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen candidate. ``rank_depth > 1`` is reported as a fallback selection."""

    index: int
    rank_depth: int = 1
    selected_after_kv_free_tokens_skip: bool = False
    prefill_tokens: int | None = None
    """The prompt tokens the pick expects the engine to prefill (None: all of them); less when the
    pick holds the request's cached prefix. The router counts this much work in flight there."""


@dataclass(frozen=True, slots=True)
class Selected:
    choice: Choice


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing is selectable yet; something may become selectable after ``ms`` milliseconds."""

    ms: float


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Nothing is selectable and no known wake-up time exists."""


UNAVAILABLE = Unavailable()

Decision = Selected | Wait | Unavailable
