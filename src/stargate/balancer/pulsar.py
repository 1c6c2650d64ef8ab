"""``pulsar`` (spec §3.5): weighted rendezvous ranking, first feasible cluster wins.

The ranking of a key depends only on the target, the key, and the candidates' cluster ids and
throughputs; it is cached per key (bounded FIFO) and the whole cache is dropped whenever that
signature changes, so cached indices always refer to the current candidate tuple. Feasibility
(exclusions, KV headroom) is rechecked live on every call.
"""

from __future__ import annotations

import random
from enum import Enum

from stargate.balancer.algorithm_spec import AlgorithmSpec
from stargate.balancer.config_schema import PulsarFields
from stargate.balancer.rendezvous import rank, rendezvous_base
from stargate.balancer.ring import KeyCache, hash_prefix
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import UNAVAILABLE, Candidate, Choice, Decision, LbRequest, Selected, Target


class Feasibility(Enum):
    ELIGIBLE = "eligible"
    RETRY_EXCLUDED = "retry_excluded"
    MISSING_KV_FREE_TOKENS = "missing_kv_free_tokens"
    INSUFFICIENT_KV_FREE_TOKENS = "insufficient_kv_free_tokens"

    @property
    def eligible(self) -> bool:
        return self is Feasibility.ELIGIBLE

    @property
    def kv_skip(self) -> bool:
        return self is Feasibility.MISSING_KV_FREE_TOKENS or self is Feasibility.INSUFFICIENT_KV_FREE_TOKENS


def feasibility(candidate: Candidate, request: LbRequest, consider_kv_free_tokens: bool) -> Feasibility:
    if candidate.cluster_id in request.excluded:
        return Feasibility.RETRY_EXCLUDED
    if not consider_kv_free_tokens:
        return Feasibility.ELIGIBLE
    stats = candidate.stats
    if not stats.has_kv_metrics:
        return Feasibility.MISSING_KV_FREE_TOKENS
    if stats.kv_cache_free_tokens < request.input_tokens:
        return Feasibility.INSUFFICIENT_KV_FREE_TOKENS
    return Feasibility.ELIGIBLE


class PulsarRanker:
    """Cached rendezvous rankings (candidate indices, best first) of one policy instance."""

    __slots__ = ("_cache", "_ids", "_last", "_prefix", "_seed", "_target", "_tps")

    def __init__(self, seed: str) -> None:
        self._seed = seed
        self._target: Target | None = None
        self._prefix = b""
        self._ids: list[str] = []
        self._tps: list[float] = []
        self._last: tuple[Candidate, ...] = ()
        self._cache: KeyCache[tuple[int, ...]] = KeyCache()

    def ranking(self, candidates: tuple[Candidate, ...], request: LbRequest) -> tuple[int, ...]:
        if candidates is not self._last or request.target != self._target:
            if request.target != self._target or not self._same_signature(candidates):
                self._reset(candidates, request.target)
            self._last = candidates
        key = request.cache_affinity_key or ""
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        ranked = rank(rendezvous_base(self._prefix, key), candidates)
        self._cache.put(key, ranked)
        return ranked

    def _same_signature(self, candidates: tuple[Candidate, ...]) -> bool:
        ids, tps = self._ids, self._tps
        if len(ids) != len(candidates):
            return False
        for index, candidate in enumerate(candidates):
            if candidate.cluster_id != ids[index] or candidate.stats.last_mean_input_tps != tps[index]:
                return False
        return True

    def _reset(self, candidates: tuple[Candidate, ...], target: Target) -> None:
        self._target = target
        self._prefix = hash_prefix(self._seed, target)
        self._ids = [candidate.cluster_id for candidate in candidates]
        self._tps = [candidate.stats.last_mean_input_tps for candidate in candidates]
        self._cache.clear()


class Pulsar:
    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        self._ranker = PulsarRanker(definition.seed)
        self._consider_kv = definition.consider_kv_free_tokens

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        if not candidates:
            return UNAVAILABLE
        kv_skipped = False
        for position, index in enumerate(self._ranker.ranking(candidates, request)):
            verdict = feasibility(candidates[index], request, self._consider_kv)
            if verdict is Feasibility.ELIGIBLE:
                return Selected(Choice(index, position + 1, kv_skipped))
            kv_skipped = kv_skipped or verdict.kv_skip
        return UNAVAILABLE


SPEC = AlgorithmSpec(Algorithm.PULSAR, build=Pulsar, fields=PulsarFields, seeded=True, kv_aware=True)
