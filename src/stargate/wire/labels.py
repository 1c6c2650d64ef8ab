"""Label children looked up without ``labels()``'s lock and validation on every request, and
series of peers that went away.

A cache holds exactly the children prometheus_client already keeps, so it adds no cardinality of
its own; a series the owner removes from the metric is forgotten here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

K = TypeVar("K", bound=Hashable)


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
        self.drop_where(lambda values: values[index] == value)

    def drop_where(self, match: Callable[[tuple[str, ...]], bool]) -> None:
        """Remove every series created here whose label values ``match``, from the metric too."""
        for values in [v for v in self._cache if match(v)]:
            del self._cache[values]
            self._metric.remove(*values)


class GoneSeries(Generic[K]):
    """Series labelled by a peer (a backend, a Stargate, a model) are dropped ``ttl_s`` after it
    went away, unless it came back: scrapes still see its last counts, and a fleet whose pods come
    back under new names does not grow the registry without end. At most ``limit`` gone peers are
    kept; past it the oldest go early, so churn faster than ``ttl_s`` is bounded too."""

    __slots__ = ("_clock", "_drop", "_gone", "_limit", "_ttl_s")

    def __init__(
        self,
        ttl_s: float,
        drop: Callable[[K], None],
        clock: Callable[[], float] = time.monotonic,
        *,
        limit: int = 1000,
    ) -> None:
        self._ttl_s = ttl_s
        self._drop = drop
        self._clock = clock
        self._limit = limit
        self._gone: dict[K, float] = {}  # peer -> when it went, oldest first

    def mark(self, peer: K, present: bool) -> None:
        self._gone.pop(peer, None)
        if not present:
            self._gone[peer] = self._clock()
        self.expire()

    def expire(self) -> None:
        cutoff = self._clock() - self._ttl_s
        while self._gone:
            peer, gone_at = next(iter(self._gone.items()))
            if gone_at > cutoff and len(self._gone) <= self._limit:
                return
            del self._gone[peer]
            self._drop(peer)
