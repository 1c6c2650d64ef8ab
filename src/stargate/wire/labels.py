"""Label children looked up without ``labels()``'s lock and validation on every request.

A cache holds exactly the children prometheus_client already keeps, so it adds no cardinality of
its own; a series the owner removes from the metric is forgotten here too.
"""

from __future__ import annotations

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
