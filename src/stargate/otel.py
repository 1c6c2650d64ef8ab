"""OpenTelemetry spans for Stargate and Pylon requests (imported only when tracing is on).

One span per request in each process, joined by W3C ``traceparent``: the incoming header is the
parent, and the header forwarded upstream names this process's span, so an engine that traces
continues the same trace. Spans go to an OTLP/HTTP exporter through a batching processor.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

PROPAGATOR = TraceContextTextMapPropagator()
Span = trace.Span


def traces_url(endpoint: str) -> str:
    """``URL/v1/traces``: the OTLP/HTTP traces path under the configured base URL."""
    base = endpoint.strip().rstrip("/")
    return base if base.endswith("/v1/traces") else f"{base}/v1/traces"


SHUTDOWN_TIMEOUT_S = 2.0
"""How long a stopping process waits for its last spans to reach the collector: one that is down
held a drained router for one 10 s export timeout per batch left, past its supervisor's grace."""


class Tracing:
    """A tracer provider of its own (no global state) with one span processor."""

    def __init__(self, service_name: str, processor: SpanProcessor) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,  # ``shutdown`` bounds it; an exit hook would wait for it unbounded
        )
        self.provider.add_span_processor(processor)
        self._tracer = self.provider.get_tracer("stargate")

    def start(self, name: str, carrier: Mapping[str, str], attributes: Mapping[str, AttributeValue]) -> Span:
        """A server span whose parent is the carrier's ``traceparent`` (a new trace without one)."""
        context = PROPAGATOR.extract(carrier)
        return self._tracer.start_span(
            name, context=context, kind=trace.SpanKind.SERVER, attributes=attributes
        )

    def inject(self, span: Span, carrier: MutableMapping[str, str]) -> None:
        """Replace the carrier's ``traceparent``/``tracestate`` with this span's: the propagator
        writes a tracestate only when the span has one, and a client's own (orphaned, or one the
        W3C rules drop) went on beside the new traceparent."""
        for name in ("traceparent", "tracestate"):
            if name in carrier:
                del carrier[name]
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))

    def end(self, span: Span, status: int, attributes: Mapping[str, AttributeValue]) -> None:
        """Close a request span with its final HTTP status (5xx marks it an error)."""
        span.set_attributes(attributes)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        span.end()

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporter, waiting at most ``SHUTDOWN_TIMEOUT_S``
        (a daemon thread: spans a collector does not take by then are dropped at exit)."""
        flush = threading.Thread(target=self.provider.shutdown, name="otel-shutdown", daemon=True)
        flush.start()
        flush.join(SHUTDOWN_TIMEOUT_S)


def otlp_http(endpoint: str, service_name: str) -> Tracing:
    return Tracing(service_name, BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
