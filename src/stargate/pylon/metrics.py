"""Pylon's Prometheus metrics on its own registry (spec pylon.md §12).

Every metric object lives on one ``PylonMetrics`` instance created at startup and passed in, so
tests get a fresh registry and never share global state. Per-request series are recorded once per
request: ``request_started`` at acceptance, ``request_finished`` at the terminal observation.
Gauges of the live load are read at scrape time (``live_metrics``); the token-count histograms
share their family names with the token counters (``token_histogram``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

from stargate.balancer.types import ModelStats
from stargate.pylon.event_counter import EventCounter
from stargate.pylon.stats.observation import Observation
from stargate.pylon.token_histogram import TokenHistogram
from stargate.wire.body_budget import BodyBudget
from stargate.wire.labels import GoneSeries, LabelChildren

TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DURATION_BUCKETS = (*TIME_BUCKETS, 60.0)
TOKEN_BUCKETS = (1, 10, 100, 1000, 10_000, 100_000, 500_000)
ADVERTISED_STATUSES = ("active", "inactive", "unknown")
QUEUE_MS_BUCKETS = (0, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000)
GONE_ROUTER_TTL_S = 600.0
"""How long the series of a Stargate that left discovery stay (reading disconnected, inactive)."""


class PylonMetrics:
    def __init__(self, version: str = "0.1.0", *, clock: Callable[[], float] = time.monotonic) -> None:
        self._gone_routers = GoneSeries(GONE_ROUTER_TTL_S, self._drop_router, clock)
        r = self.registry = CollectorRegistry(auto_describe=True)
        Gauge(
            "target_info", "Build information", ["service_version", "service_name", "commit"], registry=r
        ).labels(version, "pylon", "unknown").set(1)
        self.registration_connected = Gauge(
            "pylon_registration_stream_connected", "Registration stream open", ["router"], registry=r
        )
        # Present from the start, whatever discovery found: with no Stargate ever reached there is
        # no per-router series, and an alert on one at 0 never fired.
        self.registered_stargates = Gauge(
            "pylon_registered_stargates", "Stargates whose registration stream is open", registry=r
        )
        self.advertised_status = Gauge(
            "pylon_model_advertised_status",
            "Advertised model status",
            ["router", "model", "status"],
            registry=r,
        )
        self.requests_inflight = Gauge(
            "pylon_requests_inflight", "Proxied requests in flight", ["model"], registry=r
        )
        self.buffered_body_bytes = Gauge(
            "pylon_buffered_body_bytes", "Request body bytes held in memory", registry=r
        )
        self.requests_total = Counter(
            "pylon_requests", "Finished proxied requests", ["model", "routing_key", "status"], registry=r
        )
        self.ttrh = Histogram(
            "pylon_request_time_to_response_headers_seconds",
            "Time to upstream response headers",
            ["model", "routing_key"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.ttfo = Histogram(
            "pylon_request_time_to_first_output_seconds",
            "Time to first output message",
            ["model", "routing_key"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pylon_request_time_to_first_token_seconds",
            "Time to the first output token",
            ["model", "routing_key"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "pylon_request_duration_seconds",
            "Request duration",
            ["model", "routing_key", "status"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.input_tokens = Counter(
            "pylon_request_input_tokens",
            "Input tokens of finished requests",
            ["model", "routing_key"],
            registry=r,
        )
        self.output_tokens = Counter(
            "pylon_request_output_tokens",
            "Output tokens of finished requests",
            ["model", "routing_key"],
            registry=r,
        )
        self.input_tokens_hist = TokenHistogram(
            "pylon_request_input_tokens",
            "Input tokens per finished request",
            ["model", "routing_key"],
            TOKEN_BUCKETS,
        )
        self.output_tokens_hist = TokenHistogram(
            "pylon_request_output_tokens",
            "Output tokens per finished request",
            ["model", "routing_key"],
            TOKEN_BUCKETS,
        )
        r.register(self.input_tokens_hist)
        r.register(self.output_tokens_hist)
        self.stats_sources = Counter(
            "pylon_request_stats_sources",
            "Finished requests by the source of their token counts",
            ["model", "routing_key", "source"],
            registry=r,
        )
        # Bumped per engine stats event: scrape-time counters, not locked ``Counter`` children.
        self.stream_events = EventCounter(
            "pylon_engine_stats_stream_events", "Valid engine stats stream events", ["type"]
        )
        r.register(self.stream_events)
        self.stream_invalid = EventCounter(
            "pylon_engine_stats_stream_invalid_events", "Invalid engine stats events", ["reason"]
        )
        r.register(self.stream_invalid)
        self.stream_reconnects = Counter(
            "pylon_engine_stats_stream_reconnects", "Engine stats stream reconnects", ["reason"], registry=r
        )
        self.stream_connected = Gauge(
            "pylon_engine_stats_stream_connected", "Engine stats stream body being read", ["mode"], registry=r
        )
        self.engine_metrics_poll_failures = Counter(
            "pylon_engine_metrics_poll_failures",
            "Failed polls of the engine's Prometheus metrics page",
            ["reason"],
            registry=r,
        )
        self.stale_cleanups = Counter(
            "pylon_engine_stats_stale_cleanups", "Stale stats cleanups", ["kind"], registry=r
        )
        self.dirty_snapshots = EventCounter(
            "pylon_engine_stats_dirty_snapshots",
            "Changes that make the next published snapshot differ",
            ["source", "reason"],
        )
        r.register(self.dirty_snapshots)
        self.source_transitions = Counter(
            "pylon_engine_stats_source_transitions",
            "Stats source transitions",
            ["from", "to", "reason"],
            registry=r,
        )
        self.discovery_polls = Counter(
            "pylon_model_discovery_polls", "Model discovery polls", ["provider", "outcome"], registry=r
        )
        self.discovery_models = Gauge(
            "pylon_model_discovery_models", "Models in the last good discovery poll", ["provider"], registry=r
        )
        self.calibration_ms = Gauge(
            "pylon_model_calibration_duration_ms", "Calibration duration", ["model", "outcome"], registry=r
        )
        self.retryable = Counter(
            "pylon_retryable_responses",
            "Responses marked retryable",
            ["inference_server_id", "reason", "status"],
            registry=r,
        )
        self.nonretryable = Counter(
            "pylon_nonretryable_failures",
            "Non-2xx responses not marked retryable",
            ["inference_server_id", "reason"],
            registry=r,
        )
        self.admission = Counter(
            "pylon_queue_admission_decisions",
            "Local queue admission decisions",
            ["inference_server_id", "model_id", "result"],
            registry=r,
        )
        self.admission_expected = Histogram(
            "pylon_queue_admission_expected_ms",
            "Stargate expected queue ms",
            buckets=QUEUE_MS_BUCKETS,
            registry=r,
        )
        self.admission_actual = Histogram(
            "pylon_queue_admission_actual_ms", "Local queue estimate ms", buckets=QUEUE_MS_BUCKETS, registry=r
        )
        self.stats_capability = Gauge(
            "pylon_model_stats_capability",
            "Stats capabilities in the published snapshot",
            ["model", "capability"],
            registry=r,
        )
        self.stats_source = Gauge(
            "pylon_model_stats_source",
            "Stats sources in the published snapshot",
            ["model", "source"],
            registry=r,
        )
        self._model_gauges = {
            name: Gauge(f"pylon_model_{name}", f"Published {name}", ["model"], registry=r)
            for name in (
                "output_tps",
                "last_mean_input_tps",
                "max_output_tps",
                "queue_size",
                "queued_input_tokens",
                "kv_cache_capacity_tokens",
                "kv_cache_used_tokens",
                "kv_cache_free_tokens",
                "embedding_item_tps",
                "max_embedding_item_tps",
            )
        }
        self._models: set[str] = set()
        # Label children per model (and status): ``labels()`` locks and validates on every call.
        self._started = LabelChildren(self.requests_inflight)
        self._finished: dict[tuple[str, str], _FinishedSeries] = {}
        self._admitted = LabelChildren(self.admission)
        self._labels_published: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        self._advertised: dict[str, dict[str, str]] = {}

    def watch_body_budget(self, budget: BodyBudget) -> None:
        self.buffered_body_bytes.set_function(lambda: budget.used)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def snapshot_dirty(self, source: str, reason: str) -> None:
        self.dirty_snapshots.inc(source, reason)

    def advertise(self, router: str, statuses: dict[str, str]) -> None:
        """One-hot ``pylon_model_advertised_status`` of what was sent to ``router``; models no
        longer advertised lose their series."""
        previous = self._advertised.get(router, {})
        for model in previous.keys() - statuses.keys():
            for status in ADVERTISED_STATUSES:
                with contextlib.suppress(KeyError):
                    self.advertised_status.remove(router, model, status)
        for model, current in statuses.items():
            if previous.get(model) != current:
                for status in ADVERTISED_STATUSES:
                    self.advertised_status.labels(router, model, status).set(int(status == current))
        self._advertised[router] = dict(statuses)

    def router_lost(self, router: str) -> None:
        """On stream loss every model last advertised to ``router`` reads inactive."""
        self.advertise(router, dict.fromkeys(self._advertised.get(router, {}), "inactive"))

    def router_discovered(self, router: str, present: bool) -> None:
        """Whether discovery still lists ``router``; the series of one it no longer lists expire."""
        self._gone_routers.mark(router, present)

    def _drop_router(self, router: str) -> None:
        self.advertise(router, {})
        del self._advertised[router]
        with contextlib.suppress(KeyError):
            self.registration_connected.remove(router)

    def request_started(self, model: str) -> None:
        self._started(model).inc()

    def admission_decided(self, inference_server_id: str, model: str, result: str) -> None:
        self._admitted(inference_server_id, model, result).inc()

    def request_finished(self, obs: Observation) -> None:
        """Terminal metrics of one proxied request: count, timings, tokens; leaves the in-flight gauge."""
        model = obs.generation.model_id
        key = (model, obs.state.value)
        series = self._finished.get(key)
        if series is None:
            series = self._finished[key] = _FinishedSeries(self, model, obs.state.value)
        series.total.inc()
        series.duration.observe(obs.elapsed)
        if obs.time_to_response_headers is not None:
            series.ttrh.observe(obs.time_to_response_headers)
        if obs.time_to_first_output is not None:
            series.ttfo.observe(obs.time_to_first_output)
        if obs.time_to_first_token is not None:
            series.ttft.observe(obs.time_to_first_token)
        series.input_tokens.inc(obs.input_tokens)
        self.input_tokens_hist.observe(series.token_labels, obs.input_tokens)
        self.output_tokens_hist.observe(series.token_labels, obs.output_tokens)
        if obs.output_tokens:
            series.output_tokens.inc(obs.output_tokens)
        if obs.output_tokens_from_chunk_usage:
            series.chunk_usage.inc()
        inflight = self._started.get(model)
        if inflight is not None:
            inflight.dec()

    def publish_model(self, model: str, stats: ModelStats) -> None:
        g = self._model_gauges
        self._models.add(model)
        g["output_tps"].labels(model).set(stats.output_tps)
        g["last_mean_input_tps"].labels(model).set(stats.last_mean_input_tps)
        g["max_output_tps"].labels(model).set(stats.max_output_tps)
        g["queue_size"].labels(model).set(stats.queue_size)
        g["queued_input_tokens"].labels(model).set(stats.queued_input_size)
        g["kv_cache_capacity_tokens"].labels(model).set(stats.kv_cache_capacity_tokens)
        g["kv_cache_used_tokens"].labels(model).set(stats.kv_cache_used_tokens)
        g["kv_cache_free_tokens"].labels(model).set(stats.kv_cache_free_tokens)
        labels = (tuple(stats.stats_capabilities), tuple(stats.stats_sources))
        if self._labels_published.get(model) != labels:
            self._set_label_gauges(model, labels)

    def _set_label_gauges(self, model: str, labels: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
        old_caps, old_srcs = self._labels_published.pop(model, ((), ()))
        for gauge, old, new in (
            (self.stats_capability, old_caps, labels[0]),
            (self.stats_source, old_srcs, labels[1]),
        ):
            for value in set(old) - set(new):
                gauge.remove(model, value)
            for value in new:
                gauge.labels(model, value).set(1)
        if labels != ((), ()):
            self._labels_published[model] = labels

    def publish_embedding_items(self, model: str, tps: float, max_tps: float) -> None:
        """Pylon-only embeddings item throughput (never sent to Stargate)."""
        self._models.add(model)
        self._model_gauges["embedding_item_tps"].labels(model).set(tps)
        self._model_gauges["max_embedding_item_tps"].labels(model).set(max_tps)

    def remove_model(self, model: str) -> None:
        """Drop every model-labelled gauge series of a retired generation."""
        self.input_tokens_hist.remove_model(model)
        self.output_tokens_hist.remove_model(model)
        if model not in self._models:
            return
        self._models.discard(model)
        for gauge in self._model_gauges.values():
            gauge.remove(model)
        with contextlib.suppress(KeyError):
            self.requests_inflight.remove(model)
        self._started.forget(model)
        self._set_label_gauges(model, ((), ()))

    def render(self) -> bytes:
        self._gone_routers.expire()
        return generate_latest(self.registry)


class _FinishedSeries:
    """The label children one (model, terminal state) pair records into."""

    __slots__ = (
        "chunk_usage",
        "duration",
        "input_tokens",
        "output_tokens",
        "token_labels",
        "total",
        "ttfo",
        "ttft",
        "ttrh",
    )

    def __init__(self, metrics: PylonMetrics, model: str, state: str) -> None:
        routing_key = ""  # observations do not carry the routing key
        self.total = metrics.requests_total.labels(model, routing_key, state)
        self.duration = metrics.duration.labels(model, routing_key, state)
        self.ttrh = metrics.ttrh.labels(model, routing_key)
        self.ttfo = metrics.ttfo.labels(model, routing_key)
        self.ttft = metrics.ttft.labels(model, routing_key)
        self.input_tokens = metrics.input_tokens.labels(model, routing_key)
        self.output_tokens = metrics.output_tokens.labels(model, routing_key)
        self.chunk_usage = metrics.stats_sources.labels(model, routing_key, "chunk_usage")
        self.token_labels = (model, routing_key)
