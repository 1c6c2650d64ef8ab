"""Affinity groups for wait-and-widen: the ring selection of a cache-affinity key (spec §3.4, §3.10).

A group is computed without the request's retry exclusions, so it depends only on the key and the
candidate cluster-id sequence and can be cached per key. The ring and its cache are rebuilt whenever
that sequence (or the target) changes, so a cached index never outlives its candidate.

A key can also be *placed*: its KV cache is on the cluster one of its requests went to, outside the
ring (a yield to load, or the first request under ``cache_affinity_placement: load``). A key whose
requests outgrow its clusters' slots *spreads*: the cluster a request spilled to joins its group
instead of replacing it, since the clusters it leaves still hold its cache and the key's next
requests fill their slots again (``spread``, at most ``RESIDENCY`` clusters). Placements are kept
by cluster id, survive membership changes of other clusters, and a cluster leaves a key's group
when it leaves; the least recently used key is forgotten first.

With ``cache_affinity_prefill: growth`` the groups also remember, per key and cluster, the input
tokens of the key's last request routed there: a conversation's next turn re-sends that prompt and
adds to it, so there only the growth is left to prefill.

Router replicas each remember their own placements. ``learn`` takes the routes Pylon publishes (its
admitted requests with a key, whichever router sent them): a route newer than this router's last
one for the key places the key there, so every replica follows the newest route of a key and they
agree on where its KV cache is within one Pylon message. A key whose requests run in parallel
(one in flight on this router) is spread instead: another replica's route elsewhere is its spill.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import attrgetter

from stargate.balancer.ring import AffinityRing, KeyCache, hash_prefix
from stargate.balancer.settings import AlgorithmDefinition, Placement
from stargate.balancer.types import Candidate, Target
from stargate.wire.limits import remember_newest, remembered

_cluster_id = attrgetter("cluster_id")


PLACED_CAPACITY = 65_536
"""Placed (and routed) keys remembered; the least recently used is forgotten first."""

RESIDENCY = 16
"""Clusters a key's group spreads over (one route remembered per member); past it the oldest goes."""

_Route = tuple[str, int, float]
"""A key's last request routed to a cluster: (cluster id, input tokens, monotonic s)."""


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
        "_routed",
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
        # Least recently used first (``remember_newest``).
        self._placed: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # the key's group, newest last
        self._routed: OrderedDict[str, tuple[_Route, ...]] = OrderedDict()  # per cluster, newest last
        self._index: dict[str, int] = {}
        self._ring_placement = definition.cache_affinity_placement is Placement.RING

    def place(self, key: str, cluster_id: str) -> None:
        """The key's request went to ``cluster_id``: its KV cache is there now, so that cluster is
        the key's group from now on."""
        remember_newest(self._placed, remembered(key), (cluster_id,), PLACED_CAPACITY)

    def spread(self, key: str, group: tuple[str, ...], cluster_id: str) -> None:
        """The key's request spilled to ``cluster_id`` past its full ``group`` (cluster ids, from
        the ring or placed): that cluster joins it (the oldest member leaves past ``RESIDENCY``)."""
        remember_newest(self._placed, remembered(key), _joined(group, cluster_id), PLACED_CAPACITY)

    def routed(self, key: str, cluster_id: str, input_tokens: int, at: float) -> None:
        """The key's request of ``input_tokens`` went to ``cluster_id`` at ``at`` (monotonic s).
        Routes to clusters that left the key's group are dropped: a key keeps one per member."""
        key = remembered(key)
        route = (cluster_id, input_tokens, at)
        routes = self._routed.get(key)
        if routes is None or (len(routes) == 1 and routes[0][0] == cluster_id):
            remember_newest(self._routed, key, (route,), PLACED_CAPACITY)
            return
        members = self._placed.get(key, ())
        kept = (known for known in routes if known[0] != cluster_id and known[0] in members)
        remember_newest(self._routed, key, (*kept, route)[-RESIDENCY:], PLACED_CAPACITY)

    def learn(self, key: str, cluster_id: str, input_tokens: int, at: float, parallel: bool = False) -> None:
        """A backend of ``cluster_id`` admitted the key's request at ``at``, maybe from another
        router. When the key's requests run in ``parallel`` (this router has one in flight), a
        cluster outside its group joins the group, however old the route: another router spread
        the key there, and its cache is there. Otherwise only a route newer than the last one known
        here counts: it is remembered, and a cluster outside the group becomes the group (the key
        moved, as a conversation's next turn sent elsewhere does)."""
        key = remembered(key)
        members = self._placed.get(key, ())
        if parallel and members and cluster_id not in members:
            self.spread(key, members, cluster_id)
            self.routed(key, cluster_id, input_tokens, at)
            return
        routes = self._routed.get(key)
        if routes and routes[-1][2] >= at:
            return
        if cluster_id not in members:
            self.place(key, cluster_id)
        self.routed(key, cluster_id, input_tokens, at)

    def uncached_tokens(self, key: str, cluster_id: str, input_tokens: int) -> int | None:
        """Tokens left to prefill on ``cluster_id`` if it holds the prompt of the key's last request
        there and this one extends it; None when that is unknown (no route there, or a shorter
        prompt)."""
        for route in self._routed.get(remembered(key), ()):
            if route[0] == cluster_id:
                return input_tokens - route[1] if 0 < route[1] <= input_tokens else None
        return None

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
            slot = remembered(key)
            members = placed.pop(slot, None)
            if members is not None:
                index = self._index
                if len(members) == 1:
                    only = index.get(members[0])
                    present: tuple[int, ...] = () if only is None else (only,)
                else:
                    present = tuple(index[cluster_id] for cluster_id in members if cluster_id in index)
                    if len(present) < len(members):
                        members = tuple(cluster_id for cluster_id in members if cluster_id in index)
                if present:
                    placed[slot] = members  # most recently used last
                    return present
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
            self._routed.clear()
        self._ids = tuple(map(_cluster_id, candidates))
        self._index = {cluster_id: index for index, cluster_id in enumerate(self._ids)}
        self._target = target
        self._ring = AffinityRing(hash_prefix(self._seed, target), self._ids, self._virtual_nodes)
        self._cache.clear()
        return self._ring


def _joined(members: tuple[str, ...], cluster_id: str) -> tuple[str, ...]:
    """``members`` with ``cluster_id`` as the newest, at most ``RESIDENCY`` of them."""
    return (*(member for member in members if member != cluster_id), cluster_id)[-RESIDENCY:]

