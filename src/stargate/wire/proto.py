"""``ModelStats`` to and from its protobuf message, the one conversion both sides use.

Building a message must never raise: protobuf rejects a ``uint64`` above 2^64-1 (or below 0) with
``ValueError`` while the message is built, so every integer is saturated on the way out. A
heartbeat that cannot be built would take the Pylon out of routing.
"""

from __future__ import annotations

from itertools import islice
from types import MappingProxyType

from stargate.balancer.types import EMPTY_PRIORITY_MAP, AffinityRoute, ModelStats
from stargate.proto import stargate_pb2
from stargate.wire.limits import sat_u32, sat_u64

MAX_AFFINITY_ROUTES = 256
"""Cache-affinity routes one message carries (Pylon sends the newest) and a router reads; prefilling
keys likewise."""
MAX_AFFINITY_KEY_CHARS = 1024
"""Longer cache-affinity keys are routed as usual, but Pylon neither publishes nor remembers them."""

CACHED_PROMPT_WORK = "model.load.cached_prompt_work"
"""Stats capability of a Pylon whose published prompt work already leaves out what the engine's
prefix cache holds (``--engine-prefix-caching``): a router credits no expected cache hits on top."""


def stats_to_proto(stats: ModelStats) -> stargate_pb2.ModelStats:
    by_priority: dict[int, int] = {}
    for priority, estimate in stats.queue_time_estimate_ms_by_priority.items():
        key = sat_u32(priority)
        by_priority[key] = max(by_priority.get(key, 0), sat_u64(estimate))
    return stargate_pb2.ModelStats(
        last_mean_input_tps=float(stats.last_mean_input_tps),
        output_tps=float(stats.output_tps),
        queue_size=sat_u64(stats.queue_size),
        queued_input_size=sat_u64(stats.queued_input_size),
        max_output_tps=float(stats.max_output_tps),
        kv_cache_capacity_tokens=sat_u64(stats.kv_cache_capacity_tokens),
        kv_cache_used_tokens=sat_u64(stats.kv_cache_used_tokens),
        kv_cache_free_tokens=sat_u64(stats.kv_cache_free_tokens),
        num_running_queries=sat_u64(stats.num_running_queries),
        max_engine_concurrency=sat_u64(stats.max_engine_concurrency),
        total_query_input_size=sat_u64(stats.total_query_input_size),
        queue_time_estimate_ms_by_priority=by_priority,
        input_processing_queries=sat_u64(stats.input_processing_queries),
        output_generation_queries=sat_u64(stats.output_generation_queries),
        stats_observed_at_unix_ms=sat_u64(stats.stats_observed_at_unix_ms),
        stats_capabilities=list(stats.stats_capabilities),
        stats_sources=list(stats.stats_sources),
        recent_cache_affinity_routes=[
            stargate_pb2.CacheAffinityRoute(
                cache_affinity_key=route.key,
                input_tokens=sat_u64(route.input_tokens),
                admitted_at_unix_ms=sat_u64(route.admitted_at_unix_ms),
            )
            for route in stats.recent_cache_affinity_routes[-MAX_AFFINITY_ROUTES:]
        ],
        prefilling_cache_affinity_keys=list(
            islice(stats.prefilling_cache_affinity_keys, MAX_AFFINITY_ROUTES)
        ),
    )


def stats_from_proto(stats: stargate_pb2.ModelStats) -> ModelStats:
    """The wire stats as the immutable value every routing decision reads (once per update)."""
    by_priority = stats.queue_time_estimate_ms_by_priority
    return ModelStats(
        last_mean_input_tps=stats.last_mean_input_tps,
        output_tps=stats.output_tps,
        queue_size=stats.queue_size,
        queued_input_size=stats.queued_input_size,
        max_output_tps=stats.max_output_tps,
        kv_cache_capacity_tokens=stats.kv_cache_capacity_tokens,
        kv_cache_used_tokens=stats.kv_cache_used_tokens,
        kv_cache_free_tokens=stats.kv_cache_free_tokens,
        num_running_queries=stats.num_running_queries,
        max_engine_concurrency=stats.max_engine_concurrency,
        total_query_input_size=stats.total_query_input_size,
        queue_time_estimate_ms_by_priority=(
            MappingProxyType(dict(sorted(by_priority.items()))) if by_priority else EMPTY_PRIORITY_MAP
        ),
        input_processing_queries=stats.input_processing_queries,
        output_generation_queries=stats.output_generation_queries,
        stats_observed_at_unix_ms=stats.stats_observed_at_unix_ms,
        stats_capabilities=tuple(stats.stats_capabilities),
        stats_sources=tuple(stats.stats_sources),
        recent_cache_affinity_routes=tuple(
            AffinityRoute(route.cache_affinity_key, route.input_tokens, route.admitted_at_unix_ms)
            for route in stats.recent_cache_affinity_routes[-MAX_AFFINITY_ROUTES:]
            if route.cache_affinity_key
        ),
        prefilling_cache_affinity_keys=frozenset(
            key
            for key in stats.prefilling_cache_affinity_keys[:MAX_AFFINITY_ROUTES]
            if 0 < len(key) <= MAX_AFFINITY_KEY_CHARS
        ),
    )
