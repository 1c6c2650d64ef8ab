"""Prometheus metrics of the router (spec §6): exact names, label order and buckets.

Each ``RouterMetrics`` owns its own ``CollectorRegistry`` so several routers (tests, benches) can
live in one process. Label values use ``""`` for a missing routing key; request ids, prompts, URLs
and tokens are never labels. Routing keys and models come from client headers, so label pairs that
no registration ever advertised are bounded (``MAX_CLIENT_TARGETS``; later ones count under
``OTHER_TARGET``): random ``x-model`` values cannot grow the registry without end. Nor can a fleet
whose pods register under new ids: a backend's own series go ``DEPARTED_SERIES_TTL_S`` after its
registration ends, unless it registers again first (``GoneSeries``), and a routing target's
(``routing_key``, ``model``) series as long after its last backend left: one sidecar that
registered thousands of new model ids again and again grew a scrape past 10 MB.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from stargate.balancer.types import Target
from stargate.wire.body_budget import BodyBudget
from stargate.wire.labels import GoneSeries, LabelChildren

REPLAY_BUFFER_BUCKETS = (0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
PROXY_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
ROUTING_DURATION_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1)
DEFAULT_PREFIX = "stargate_"
MAX_CLIENT_TARGETS = 1000
"""Distinct ``(routing_key, model)`` label pairs taken from requests alone (never registered)."""
MAX_CLIENT_LABEL_CHARS = 256
"""The longest unregistered ``routing_key`` or ``model`` kept as a label: 1 000 pairs of 8 KB header
values made one scrape 16 MB, 150-200 ms of the router's event loop."""
OTHER_TARGET = "__other__"
"""Both labels of a request whose unregistered target came after the first ``MAX_CLIENT_TARGETS``,
or has a label longer than ``MAX_CLIENT_LABEL_CHARS``."""
DEPARTED_SERIES_TTL_S = 600.0
"""How long the series of a backend whose registration ended stay: scrapes see its last counts."""


def _counter_name(prefix: str, name: str) -> str:
    # prometheus_client appends "_total" itself; pass the base name so the exposed name is exact.
    return f"{prefix}{name}".removesuffix("_total")


class RouterMetrics:
    """All router series. Methods take a ``Target`` so label spelling lives in one place."""

    def __init__(
        self,
        prefix: str = DEFAULT_PREFIX,
        registry: CollectorRegistry | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        tgt = ("routing_key", "model")
        self.requests_total = Counter(
            _counter_name(prefix, "requests_total"),
            "Finished proxied requests.",
            (*tgt, "inference_server_id", "status"),
            registry=reg,
        )
        self.responses_cut_total = Counter(
            _counter_name(prefix, "responses_cut_total"),
            "Answers that ended after their status was sent, before their end: by the backend or the client.",
            (*tgt, "inference_server_id", "by"),
            registry=reg,
        )
        self.proxy_attempts_total = Counter(
            _counter_name(prefix, "proxy_attempts_total"),
            "Upstream attempts.",
            (*tgt, "inference_server_id", "result"),
            registry=reg,
        )
        self.proxy_retries_total = Counter(
            _counter_name(prefix, "proxy_retries_total"),
            "Proxy retries by reason.",
            (*tgt, "reason"),
            registry=reg,
        )
        self.routing_selections_total = Counter(
            _counter_name(prefix, "routing_selections_total"),
            "Cluster selections.",
            (*tgt, "algorithm", "selection"),
            registry=reg,
        )
        self.routing_kv_free_token_fallback_selections_total = Counter(
            _counter_name(prefix, "routing_kv_free_token_fallback_selections_total"),
            "Selections reached after a higher-ranked candidate failed the KV check.",
            (*tgt, "algorithm"),
            registry=reg,
        )
        self.proxy_retry_exhausted_total = Counter(
            _counter_name(prefix, "proxy_retry_exhausted_total"),
            "Requests that ran out of retries.",
            (*tgt, "reason"),
            registry=reg,
        )
        self.admission_rejections_total = Counter(
            _counter_name(prefix, "admission_rejections_total"),
            "Input-work admission rejections.",
            (*tgt, "reason"),
            registry=reg,
        )
        self.quic_connection_evictions_total = Counter(
            _counter_name(prefix, "quic_connection_evictions_total"),
            "Hot-path connection evictions.",
            ("inference_server_id", "reason"),
            registry=reg,
        )
        self.quic_hot_path_reconnect_total = Counter(
            _counter_name(prefix, "quic_hot_path_reconnect_total"),
            "Hot-path reconnects.",
            ("inference_server_id", "result"),
            registry=reg,
        )
        self.tls_reloads_total = Counter(
            _counter_name(prefix, "tls_reloads_total"),
            "TLS identity reload attempts.",
            ("material_type", "result"),
            registry=reg,
        )
        for result in ("success", "rejected"):
            self.tls_reloads_total.labels("server_identity", result)
        self.proxy_replay_buffer_bytes = Histogram(
            f"{prefix}proxy_replay_buffer_bytes",
            "Buffered request body bytes per attempt.",
            ("model",),
            buckets=REPLAY_BUFFER_BUCKETS,
            registry=reg,
        )
        self.proxy_duration_seconds = Histogram(
            f"{prefix}proxy_duration_seconds",
            "Seconds from request arrival to upstream response headers.",
            (*tgt, "inference_server_id"),
            buckets=PROXY_DURATION_BUCKETS,
            registry=reg,
        )
        self.routing_duration_seconds = Histogram(
            f"{prefix}routing_duration_seconds",
            "Seconds from routing start to the first backend selection.",
            tgt,
            buckets=ROUTING_DURATION_BUCKETS,
            registry=reg,
        )
        self.active_inference_servers = Gauge(
            f"{prefix}active_inference_servers",
            "Active backends per routing target.",
            tgt,
            registry=reg,
        )
        self.proxy_buffered_body_bytes = Gauge(
            f"{prefix}proxy_buffered_body_bytes",
            "Request body bytes held in memory (replay buffers and plain-client reads).",
            registry=reg,
        )
        self.tls_certificate_expiry_seconds = Gauge(
            f"{prefix}tls_certificate_expiry_seconds",
            "Unix expiry of a provided TLS identity.",
            ("material_type",),
            registry=reg,
        )

        self._requests = LabelChildren(self.requests_total)
        self._attempts = LabelChildren(self.proxy_attempts_total)
        self._cut = LabelChildren(self.responses_cut_total)
        self._retries = LabelChildren(self.proxy_retries_total)
        self._exhausted = LabelChildren(self.proxy_retry_exhausted_total)
        self._selections = LabelChildren(self.routing_selections_total)
        self._kv_fallbacks = LabelChildren(self.routing_kv_free_token_fallback_selections_total)
        self._admission = LabelChildren(self.admission_rejections_total)
        self._replay = LabelChildren(self.proxy_replay_buffer_bytes)
        self._proxy_duration = LabelChildren(self.proxy_duration_seconds)
        self._routing_duration = LabelChildren(self.routing_duration_seconds)
        self._active = LabelChildren(self.active_inference_servers)
        self._evictions = LabelChildren(self.quic_connection_evictions_total)
        self._reconnects = LabelChildren(self.quic_hot_path_reconnect_total)
        # every family labelled by backend, with the position of that label
        self._per_backend = (
            (self._requests, 2), (self._attempts, 2), (self._cut, 2), (self._proxy_duration, 2),
            (self._evictions, 0), (self._reconnects, 0),
        )  # fmt: skip
        # every family labelled by target, with routing_key and model first
        self._per_target = (
            self._requests, self._attempts, self._cut, self._retries, self._exhausted, self._selections,
            self._kv_fallbacks, self._admission, self._proxy_duration, self._routing_duration,
            self._active,
        )  # fmt: skip
        self._gone = GoneSeries(DEPARTED_SERIES_TTL_S, self._drop_backend, clock)
        self._gone_targets: GoneSeries[tuple[str, str]] = GoneSeries(
            DEPARTED_SERIES_TTL_S, self._drop_target, clock
        )
        self._registered: set[tuple[str, str]] = set()
        self._client_targets: set[tuple[str, str]] = set()

    def render(self) -> bytes:
        self._gone.expire()
        self._gone_targets.expire()
        return generate_latest(self.registry)

    def backend_live(self, backend_id: str, live: bool) -> None:
        """A registration of ``backend_id`` began (``live``) or ended."""
        self._gone.mark(backend_id, live)

    def _drop_backend(self, backend_id: str) -> None:
        for children, index in self._per_backend:
            children.drop(index, backend_id)

    def _drop_target(self, pair: tuple[str, str]) -> None:
        self._registered.discard(pair)
        for children in self._per_target:
            children.drop_where(lambda values: values[:2] == pair)
        model = pair[1]
        if not any(m == model for _, m in self._registered | self._client_targets):
            self._replay.drop(0, model)

    # -- per-event helpers -------------------------------------------------------------------------

    def _tgt(self, target: Target) -> tuple[str, str]:
        """The target's label pair; an unregistered one past the caps becomes ``OTHER_TARGET``."""
        pair = (target.routing_key or "", target.model_id)
        if pair in self._registered or pair in self._client_targets:
            return pair
        short = len(pair[0]) <= MAX_CLIENT_LABEL_CHARS and len(pair[1]) <= MAX_CLIENT_LABEL_CHARS
        if short and len(self._client_targets) < MAX_CLIENT_TARGETS:
            self._client_targets.add(pair)
            return pair
        return (OTHER_TARGET, OTHER_TARGET)

    def set_active(self, target: Target, count: int, advertised: bool = True) -> None:
        """A registration-side change of ``target``: ``count`` active backends serve it now (0 stays
        visible, for alerts); its series go ``DEPARTED_SERIES_TTL_S`` after no registration lists
        it (``advertised``) any more."""
        pair = (target.routing_key or "", target.model_id)
        self._registered.add(pair)
        self._active(*pair).set(count)
        self._gone_targets.mark(pair, advertised)

    def request_finished(self, target: Target, backend_id: str, status: int) -> None:
        self._requests(*self._tgt(target), backend_id, str(status)).inc()

    def response_cut(self, target: Target, backend_id: str, by: str) -> None:
        """The answer's status went out (``requests_total`` counts it) and its body did not end:
        ``by`` is ``backend`` (its answer broke; the client's connection was aborted) or
        ``client`` (it hung up mid-answer)."""
        self._cut(*self._tgt(target), backend_id, by).inc()

    def attempt(self, target: Target, backend_id: str, result: str) -> None:
        self._attempts(*self._tgt(target), backend_id, result).inc()

    def retry(self, target: Target, reason: str) -> None:
        self._retries(*self._tgt(target), reason).inc()

    def retry_exhausted(self, target: Target, reason: str) -> None:
        self._exhausted(*self._tgt(target), reason).inc()

    def selection(self, target: Target, algorithm: str, rank_depth: int, kv_fallback: bool) -> None:
        kind = "primary" if rank_depth <= 1 else "fallback"
        self._selections(*self._tgt(target), algorithm, kind).inc()
        if kv_fallback:
            self._kv_fallbacks(*self._tgt(target), algorithm).inc()

    def admission_rejected(self, target: Target, reason: str) -> None:
        self._admission(*self._tgt(target), reason).inc()

    def replay_buffer(self, target: Target, buffered: int) -> None:
        self._replay(self._tgt(target)[1]).observe(buffered)

    def watch_body_budget(self, budget: BodyBudget) -> None:
        self.proxy_buffered_body_bytes.set_function(lambda: budget.used)

    def proxy_duration(self, target: Target, backend_id: str, seconds: float) -> None:
        self._proxy_duration(*self._tgt(target), backend_id).observe(seconds)

    def routing_duration(self, target: Target, seconds: float) -> None:
        self._routing_duration(*self._tgt(target)).observe(seconds)

    def eviction(self, backend_id: str, reason: str) -> None:
        self._evictions(backend_id, reason).inc()

    def reconnect(self, backend_id: str, ok: bool) -> None:
        self._reconnects(backend_id, "success" if ok else "error").inc()
