"""Affinity groups for wait-and-widen: the ring selection of a cache-affinity key (spec §3.4, §3.10).

A group is computed without the request's retry exclusions, so it depends only on the key and the
candidate cluster-id sequence and can be cached per key. The ring and its cache are rebuilt whenever
that sequence (or the target) changes, so a cached index never outlives its candidate.

A key can also be *placed*: its KV cache is on the cluster one of its requests went to, outside the
ring (a yield to load, or the first request under ``cache_affinity_placement: load``). Placements
are kept by cluster id, survive membership changes of other clusters, and end when their cluster
leaves; the least recently used is forgotten first.
"""

from __future__ import annotations

from operator import attrgetter

from stargate.balancer.ring import AffinityRing, KeyCache, hash_prefix
from stargate.balancer.settings import AlgorithmDefinition, Placement
from stargate.balancer.types import Candidate, Target

_cluster_id = attrgetter("cluster_id")


PLACED_CAPACITY = 65_536
"""Placed keys remembered; the least recently used is forgotten first."""


class AffinityGroups:
    __slots__ = (
        "_cache",
        "_count",
        "_ids",
        "_index",
        "_last",
        "_placed",
        "_ring",
        "_ring_placement",
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
        self._placed: dict[str, str] = {}
        self._index: dict[str, int] = {}
        self._ring_placement = definition.cache_affinity_placement is Placement.RING

    def place(self, key: str, cluster_id: str) -> None:
        """The key's request went to ``cluster_id``: its KV cache is there now, so that cluster is
        the key's group from now on."""
        placed = self._placed
        placed.pop(key, None)
        if len(placed) >= PLACED_CAPACITY:
            del placed[next(iter(placed))]
        placed[key] = cluster_id

    def group(self, candidates: tuple[Candidate, ...], target: Target, key: str) -> tuple[int, ...]:
        """Candidate indices of the key's affinity group (exclusions not applied); empty when the
        key is to be placed by load and has no placement yet."""
        ring = self._ring
        if ring is None or candidates is not self._last or target != self._target:
            if ring is None or target != self._target or not self._same_ids(candidates):
                ring = self._rebuild(candidates, target)
            self._last = candidates
        placed = self._placed
        if placed:
            cluster_id = placed.pop(key, None)
            if cluster_id is not None:
                index = self._index.get(cluster_id)
                if index is not None:
                    placed[key] = cluster_id  # most recently used last
                    return (index,)
        if not self._ring_placement:
            return ()
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        selected = ring.select(key, self._count)
        self._cache.put(key, selected)
        return selected

    def _same_ids(self, candidates: tuple[Candidate, ...]) -> bool:
        return len(self._ids) == len(candidates) and self._ids == tuple(map(_cluster_id, candidates))

    def _rebuild(self, candidates: tuple[Candidate, ...], target: Target) -> AffinityRing:
        if self._target is not None and target != self._target:
            self._placed.clear()
        self._ids = tuple(map(_cluster_id, candidates))
        self._index = {cluster_id: index for index, cluster_id in enumerate(self._ids)}
        self._target = target
        self._ring = AffinityRing(hash_prefix(self._seed, target), self._ids, self._virtual_nodes)
        self._cache.clear()
        return self._ring
