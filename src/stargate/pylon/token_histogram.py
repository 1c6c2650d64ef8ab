"""``pylon_request_input_tokens`` / ``pylon_request_output_tokens`` histograms (spec pylon.md §12).

The spec gives these histograms the family names of the ``…_tokens_total`` counters. The text
exposition keeps them apart (``_bucket``/``_sum``/``_count`` beside ``_total``), but
``prometheus_client`` refuses to register both, so the histograms are a collector of their own that
reserves no names and emits no ``_created`` sample (which the counter already has).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class TokenHistogram(Collector):
    def __init__(
        self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._bounds = [float(b) for b in buckets]
        self._series: dict[tuple[str, ...], _Series] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = _Series(len(self._bounds) + 1)
        series.counts[bisect.bisect_left(self._bounds, value)] += 1
        series.total += value

    def remove_model(self, model: str) -> None:
        """Drop the series whose first label (the model) is ``model``."""
        for key in [k for k in self._series if k[0] == model]:
            del self._series[key]

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        bounds = [*(_le(b) for b in self._bounds), "+Inf"]
        for labels, series in self._series.items():
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, series.counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(list(labels), buckets, series.total)
        yield family


def _le(bound: float) -> str:
    return str(int(bound)) + ".0" if bound.is_integer() else repr(bound)


class _Series:
    __slots__ = ("counts", "total")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self.total = 0.0
