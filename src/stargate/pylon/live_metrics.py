"""Pylon gauges read at scrape time (spec pylon.md §12), so requests pay nothing for them.

``pylon_requests_state{model,state}`` and ``pylon_requests_state_input_tokens{model,state}`` come from
the live load table (states: pending, input_processing, output_generation);
``pylon_engine_stats_live_requests{source}`` counts the per-request counter entries and
``pylon_engine_stats_model_states{source}`` the generations in stats aggregation, labelled with the
counter source in use (``engine_stats_stream`` once the engine stream delivered, else
``chunk_usage``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from stargate.pylon.load import LiveLoad, Phase

STATE_NAMES = tuple(phase.name.lower() for phase in Phase)


class LiveLoadCollector(Collector):
    def __init__(
        self,
        load: LiveLoad,
        counter_entries: Callable[[], int],
        model_states: Callable[[], int],
        counter_source: Callable[[], str],
    ) -> None:
        self._load = load
        self._counter_entries = counter_entries
        self._model_states = model_states
        self._counter_source = counter_source

    def describe(self) -> list[Metric]:
        # Nothing to reserve: these names are not declared by any other collector.
        return []

    def collect(self) -> Iterator[Metric]:
        counts = GaugeMetricFamily(
            "pylon_requests_state", "Proxied requests per live state", labels=["model", "state"]
        )
        tokens = GaugeMetricFamily(
            "pylon_requests_state_input_tokens",
            "Input tokens of proxied requests per live state",
            labels=["model", "state"],
        )
        for generation, phase_counts, phase_tokens in self._load.phase_totals():
            for state, count, input_tokens in zip(STATE_NAMES, phase_counts, phase_tokens, strict=True):
                counts.add_metric([generation.model_id, state], count)
                tokens.add_metric([generation.model_id, state], input_tokens)
        source = self._counter_source()
        live = GaugeMetricFamily(
            "pylon_engine_stats_live_requests", "Live per-request counter entries", labels=["source"]
        )
        live.add_metric([source], self._counter_entries())
        models = GaugeMetricFamily(
            "pylon_engine_stats_model_states", "Model generations in stats aggregation", labels=["source"]
        )
        models.add_metric([source], self._model_states())
        yield from (counts, tokens, live, models)
