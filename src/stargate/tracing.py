"""Request tracing switch and the routing facts a Stargate span reports (spec stargate.md §6).

Tracing is off unless ``--otel-endpoint`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``) is given; then
``stargate.otel`` (the optional ``otel`` extra: OpenTelemetry SDK and OTLP/HTTP exporter) exports
spans to ``URL/v1/traces``. When off, nothing of OpenTelemetry is imported and the request paths
only test ``tracing is None``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from stargate.errors import ConfigError

if TYPE_CHECKING:
    from stargate.otel import Tracing


@dataclass(slots=True)
class RouteTrace:
    """What the attempt driver saw of one request's routing: its span's facts while tracing, and
    always ``at_backend``."""

    rank_depth: int = 0
    waited_s: float = 0.0
    attempts: int = 0
    backend_id: str = ""
    cluster_id: str = ""
    retry_reasons: list[str] = field(default_factory=list)
    at_backend: str = ""
    """The backend whose answer the request awaits now ("" while it is routed): a client that
    hangs up is counted against it."""
    relayed_status: int = 0
    """The status of the answer being relayed (0 before one): a client that hangs up meanwhile is
    counted with it, not 499, in the metrics and on the span alike."""


def setup_tracing(endpoint: str | None, service_name: str, flag: str = "--otel-endpoint") -> Tracing | None:
    """An OTLP/HTTP exporting tracer for ``endpoint``, or None when no endpoint is set."""
    url = (endpoint or "").strip()
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"expected an http:// or https:// URL of an OTLP collector, got {url!r}", path=flag)
    try:
        otel = importlib.import_module("stargate.otel")  # the optional extra, loaded only when tracing
    except ImportError as exc:
        raise ConfigError(
            "tracing needs the otel extra: pip install 'stargate-router[otel]'", path=flag
        ) from exc
    tracing: Tracing = otel.otlp_http(url, service_name)
    return tracing
