"""Normalised algorithm settings: what `lb-config.json` parses into and what policies are built from.

One flat frozen definition serves every algorithm; fields an algorithm does not use keep their
defaults (the parser rejects them in JSON). Definitions compare by identity: two independently
constructed definitions are distinct even with equal settings, because each owns its own policy
instances (round-robin counters, caches).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from stargate.balancer.types import AffinityRoute, Candidate, Decision, LbRequest


class Algorithm(StrEnum):
    POWER_OF_N = "power-of-n"
    WAIT_AND_WIDEN = "wait-and-widen"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    PULSAR = "pulsar"
    PULSAR_WAIT_AND_WIDEN = "pulsar-wait-and-widen"


class Placement(StrEnum):
    """Where a cache-affinity key's first request goes (wait-and-widen)."""

    RING = "ring"  # the key's ring selection: every replica agrees without talking
    LOAD = "load"  # the best load-aware estimate; this replica then remembers the key there


class PrefillEstimate(StrEnum):
    """How wait-and-widen estimates the prefill of a request on its affinity group."""

    SCALE = "scale"  # input tokens x cache_affinity_input_tokens_scale (the original)
    GROWTH = "growth"  # what the prompt grew by since the key's last request there


class PrefillRate(StrEnum):
    """Which prefill throughput the load-aware estimates divide by."""

    PUBLISHED = "published"  # Pylon's ``last_mean_input_tps`` (the original's only input)
    MEASURED = "measured"  # the larger of that and this router's own measure of the cluster


class Comparator(StrEnum):
    TTFT = "ttft"
    QUEUE_TIME = "queue-time"
    INPUT_WORK_SECONDS = "input-work-seconds"
    UTILIZATION = "utilization"
    NUM_REQUESTS_QUEUED = "num-requests-queued"


@dataclass(frozen=True, eq=False, slots=True)
class AlgorithmDefinition:
    """Normalised settings of one configured algorithm (spec §2.4, defaults applied)."""

    algorithm: Algorithm
    # common
    require_cache_affinity_key: bool = False
    require_input_tokens: bool = False
    max_input_work_seconds: float | None = None
    # power-of-n
    sample_count: int = 2
    # power-of-n, wait-and-widen (None for algorithms without a comparator)
    comparator: Comparator | None = None
    # wait-and-widen family and pulsar
    seed: str = ""
    virtual_nodes: int = 150
    selection_count: int | None = None
    queue_slo_ms: tuple[int, int] | None = None  # (floor, ceil), only when both are set
    ttft_bucket_size_ms: int = 20
    next_bucket_unlock_factor: float = 0.25
    n: int = 2
    max_queued: int = 0
    ignore_queue_time: bool = False
    ignore_input_processing_time: bool = False
    consider_kv_free_tokens: bool = False
    cache_affinity_wait_ms: int = 0
    cache_affinity_input_tokens_scale: float = 1.0
    # load-aware routing (power-of-n, wait-and-widen): not in the original, off by default
    load_aware: bool = False
    prefill_rate: PrefillRate = PrefillRate.PUBLISHED
    cache_affinity_yield_margin_ms: int | None = None  # None: hold the affinity group until X
    cache_affinity_placement: Placement = Placement.RING
    cache_affinity_prefill: PrefillEstimate = PrefillEstimate.SCALE
    cache_affinity_await_prefill: bool = False
    cache_affinity_spill: bool = False
    prefill_sharing: bool = False


class Policy(Protocol):
    """A load balancer instance: one per (routing-target generation, definition).

    ``decide`` is synchronous and pure apart from the policy's own counters and caches; time
    comes from the request and randomness from ``rng``.
    """

    definition: AlgorithmDefinition

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        ...


@runtime_checkable
class RouteLearner(Protocol):
    """A policy that remembers where keys went and learns where other routers sent them."""

    def learn_routes(
        self,
        cluster_id: str,
        routes: Sequence[AffinityRoute],
        offset_s: float,
        in_flight: Callable[[str], bool],
    ) -> None:
        ...
