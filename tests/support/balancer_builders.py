"""Small builders for balancer tests: candidates, requests and definitions with readable defaults."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from stargate.balancer import (
    Algorithm,
    AlgorithmDefinition,
    Candidate,
    Choice,
    Comparator,
    Decision,
    LbRequest,
    ModelStats,
    Selected,
    Target,
)

TARGET = Target("rk-1", "model-a")


def make_stats(
    *,
    tps: float = 100.0,
    queued: int = 0,
    queue_size: int = 0,
    running: int = 0,
    max_concurrency: int = 0,
    queue_map: Mapping[int, int] | None = None,
    kv_free: int = 0,
    kv_capacity: int = 0,
    kv_used: int = 0,
) -> ModelStats:
    return ModelStats(
        last_mean_input_tps=tps,
        queued_input_size=queued,
        queue_size=queue_size,
        num_running_queries=running,
        max_engine_concurrency=max_concurrency,
        queue_time_estimate_ms_by_priority=MappingProxyType(dict(queue_map or {})),
        kv_cache_free_tokens=kv_free,
        kv_cache_capacity_tokens=kv_capacity,
        kv_cache_used_tokens=kv_used,
    )


def make_candidate(cluster_id: str, *, rtt_ms: float = 1.0, **stats: Any) -> Candidate:
    return Candidate(cluster_id=cluster_id, stats=make_stats(**stats), rtt_s=rtt_ms / 1000.0)


def make_request(
    *,
    input_tokens: int = 0,
    elapsed_ms: float = 0.0,
    priority: int = 0,
    key: str | None = None,
    slo_ms: int | None = None,
    excluded: Iterable[str] = (),
    target: Target = TARGET,
) -> LbRequest:
    return LbRequest(
        target=target,
        input_tokens=input_tokens,
        received_at=0.0,
        now=elapsed_ms / 1000.0,
        priority=priority,
        cache_affinity_key=key,
        request_slo_ms=slo_ms,
        excluded=frozenset(excluded),
    )


def waw(**settings: Any) -> AlgorithmDefinition:
    settings.setdefault("comparator", Comparator.TTFT)
    return AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN, **settings)


def chosen(decision: Decision) -> Choice:
    assert isinstance(decision, Selected), decision
    return decision.choice


def chosen_id(candidates: tuple[Candidate, ...], decision: Decision) -> str:
    return candidates[chosen(decision).index].cluster_id


def rng(seed: int = 7) -> random.Random:
    return random.Random(seed)
