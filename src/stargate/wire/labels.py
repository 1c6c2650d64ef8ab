"""Label children looked up without ``labels()``'s lock and validation on every request, and
series of peers that went away.

A cache holds exactly the children prometheus_client already keeps, so it adds no cardinality of
its own; a series the owner removes from the metric is forgotten here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram


class LabelChildren:
    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: Counter | Histogram | Gauge) -> None:
        self._metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child

    def get(self, *values: str) -> Any | None:
        """The child when it was created through this cache, else ``None`` (nothing is created)."""
        return self._cache.get(values)

    def forget(self, *values: str) -> None:
        self._cache.pop(values, None)

    def drop(self, index: int, value: str) -> None:
        """Remove every series created here whose label at ``index`` is ``value``, from the metric too."""
        for values in [v for v in self._cache if v[index] == value]:
            del self._cache[values]
            self._metric.remove(*values)


class GoneSeries:
    """Series labelled by a peer (a backend, a Stargate) are dropped ``ttl_s`` after it went away,
    unless it came back: scrapes still see its last counts, and a fleet whose pods come back under
    new names does not grow the registry without end."""

    __slots__ = ("_clock", "_drop", "_gone", "_ttl_s")

    def __init__(
        self, ttl_s: float, drop: Callable[[str], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._drop = drop
        self._clock = clock
        self._gone: dict[str, float] = {}  # peer -> when it went, oldest first

    def mark(self, peer: str, present: bool) -> None:
        self._gone.pop(peer, None)
        if not present:
            self._gone[peer] = self._clock()
        self.expire()

    def expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._gone:
            peer, gone_at = next(iter(self._gone.items()))
            if gone_at > cutoff:
                return
            del self._gone[peer]
            self._drop(peer)
