"""Affinity groups for wait-and-widen: the ring selection of a cache-affinity key (spec §3.4, §3.10).

A group is computed without the request's retry exclusions, so it depends only on the key and the
candidate cluster-id sequence and can be cached per key. With a yield margin a key can also follow
its cache: once a request of the key yielded to load, the key's group is the cluster it went to.
The ring and both maps are rebuilt whenever that sequence (or the target) changes, so a cached index
never outlives its candidate.
"""

from __future__ import annotations

from operator import attrgetter

from stargate.balancer.ring import AffinityRing, KeyCache, hash_prefix
from stargate.balancer.settings import AlgorithmDefinition
from stargate.balancer.types import Candidate, Target

_cluster_id = attrgetter("cluster_id")


MOVED_CAPACITY = 65_536
"""Keys whose cache moved with a request that yielded to load; the oldest is forgotten first."""


class AffinityGroups:
    __slots__ = (
        "_cache",
        "_count",
        "_ids",
        "_last",
        "_moved",
        "_ring",
        "_seed",
        "_target",
        "_virtual_nodes",
    )

    def __init__(self, definition: AlgorithmDefinition, selection_count: int) -> None:
        self._seed = definition.seed
        self._virtual_nodes = max(1, definition.virtual_nodes)
        self._count = selection_count
        self._target: Target | None = None
        self._ids: tuple[str, ...] = ()
        self._ring: AffinityRing | None = None
        self._last: tuple[Candidate, ...] = ()
        self._cache: KeyCache[tuple[int, ...]] = KeyCache()
        self._moved: dict[str, tuple[int, ...]] = {}

    def follow(self, key: str, index: int) -> None:
        """The key's request went to ``index`` outside its group: its KV cache is there now, so the
        key's group becomes that cluster (until the candidate sequence changes)."""
        moved = self._moved
        moved.pop(key, None)
        if len(moved) >= MOVED_CAPACITY:
            del moved[next(iter(moved))]
        moved[key] = (index,)

    def group(self, candidates: tuple[Candidate, ...], target: Target, key: str) -> tuple[int, ...]:
        """Candidate indices of the key's original affinity group (exclusions not applied)."""
        ring = self._ring
        if ring is None or candidates is not self._last or target != self._target:
            if ring is None or target != self._target or not self._same_ids(candidates):
                ring = self._rebuild(candidates, target)
            self._last = candidates
        moved = self._moved.get(key) if self._moved else None
        if moved is not None:
            return moved
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        selected = ring.select(key, self._count)
        self._cache.put(key, selected)
        return selected

    def _same_ids(self, candidates: tuple[Candidate, ...]) -> bool:
        return len(self._ids) == len(candidates) and self._ids == tuple(map(_cluster_id, candidates))

    def _rebuild(self, candidates: tuple[Candidate, ...], target: Target) -> AffinityRing:
        self._ids = tuple(map(_cluster_id, candidates))
        self._target = target
        self._ring = AffinityRing(hash_prefix(self._seed, target), self._ids, self._virtual_nodes)
        self._cache.clear()
        self._moved.clear()
        return self._ring
