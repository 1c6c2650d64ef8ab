"""Labelled counters bumped once per engine stats event or per load change (spec pylon.md §12).

A ``prometheus_client`` ``Counter`` costs a lock, label validation and a child lookup on every
increment, which adds up on paths taken dozens of times per proxied request. ``EventCounter`` keeps
plain per-label-set counts and builds the samples at scrape time; the exposition is the same as a
``Counter``'s (``_total`` and ``_created`` per label set, the family described even with no series,
``PROMETHEUS_DISABLE_CREATED_SERIES`` honoured).
Increments must come from one thread (Pylon's event loop).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from prometheus_client import metrics as client_metrics
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector


class EventCounter(Collector):
    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = list(labels)
        self._counts: dict[tuple[str, ...], float] = {}
        self._created: dict[tuple[str, ...], float] = {}

    def inc(self, *values: str) -> None:
        """Add one to the series of ``values`` (one per label, in order)."""
        counts = self._counts
        if values in counts:
            counts[values] += 1.0
        else:
            counts[values] = 1.0
            self._created[values] = time.time()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labels)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        # As a Counter: no _created series when prometheus_client's switch turned them off.
        with_created = client_metrics._use_created
        for values, count in self._counts.items():
            family.add_metric(list(values), count, created=self._created[values] if with_created else None)
        yield family
