"""OpenTelemetry spans (in-memory exporter): one per request in Stargate with the routing decision
and one in Pylon with admission and engine timing, joined by W3C ``traceparent`` from the gateway
through Stargate and Pylon to the engine."""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest
from grpc import aio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from support.pylon_fakes import FakeEngine
from support.stargate_harness import Reply, ScriptedBackend, registration, rejection, settings
from support.waiting import until

from stargate import otel
from stargate.errors import ConfigError
from stargate.otel import Tracing, traces_url
from stargate.proto import stargate_pb2_grpc
from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings
from stargate.router.app import StargateServer
from stargate.tracing import setup_tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
GATEWAY_SPAN = "00f067aa0ba902b7"
GATEWAY = {"traceparent": f"00-{TRACE_ID}-{GATEWAY_SPAN}-01"}
CHAT = orjson.dumps({"model": "llama", "messages": [], "stream": True})
HEADERS = {"x-request-id": "r-traced", "x-model": "llama", "x-input-tokens": "10", **GATEWAY}


@dataclass
class Exported:
    exporter: InMemorySpanExporter

    def tracing(self, service: str) -> Tracing:
        return Tracing(service, SimpleSpanProcessor(self.exporter))

    def one(self, name: str) -> ReadableSpan:
        (span,) = [s for s in self.exporter.get_finished_spans() if s.name == name]
        return span


@pytest.fixture
def exported() -> Exported:
    return Exported(InMemorySpanExporter())


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def parent_id(span: ReadableSpan) -> str:
    assert span.parent is not None
    return f"{span.parent.span_id:016x}"


def trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


@contextlib.asynccontextmanager
async def traced_fleet(exported: Exported, engine: FakeEngine) -> AsyncIterator[str]:
    """Stargate and Pylon in front of ``engine``, both tracing: the chat URL."""
    server = StargateServer(settings(), tracing=exported.tracing("stargate"))
    pylon: PylonApp | None = None
    try:
        bound = await server.start()
        pylon = PylonApp(
            parse_settings(["--upstream-http-base-url", engine.url, "--stargate-address", bound.grpc,
                            "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--model-name", "llama",
                            "--disable-bringup", "--initial-input-tps", "1000",
                            "--min-update-interval-ms", "50"]),
            out=io.StringIO(),
            tracing=exported.tracing("pylon"),
        )  # fmt: skip
        await pylon.start()
        await until("llama registered", lambda: server.state.list_models(None, []) == ["llama"])
        yield f"http://{bound.http}/v1/chat/completions"
    finally:
        if pylon is not None:
            await pylon.close()
        await server.shutdown(drain_timeout_s=1.0)


async def test_gateway_stargate_pylon_engine_share_one_trace(exported: Exported, engine: FakeEngine) -> None:
    async with (
        traced_fleet(exported, engine) as url,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http,
        http.post(url, data=CHAT, headers=HEADERS) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    routed, relayed = exported.one("proxy_openai_request"), exported.one("pylon_request")
    assert (trace_id(routed), parent_id(routed)) == (TRACE_ID, GATEWAY_SPAN)
    assert (trace_id(relayed), parent_id(relayed)) == (TRACE_ID, span_id(routed))
    (sent,) = [h for _, path, h, _ in engine.requests if path == "/v1/chat/completions"]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{span_id(relayed)}-01"
    assert routed.resource.attributes["service.name"] == "stargate"
    assert dict(routed.attributes or {}) == {
        "request.id": "r-traced",
        "model": "llama",
        "routing.algorithm": "power-of-n",
        "routing.rank_depth": 1,
        "routing.wait_ms": 0,
        "routing.retry_attempts": 0,
        "proxy.attempt": 1,
        "proxy.retry_reason": (),
        "selected_inst.id": "pylon",
        "selected_cluster.id": "pylon",
        "http.response.status_code": 200,
    }
    attributes = dict(relayed.attributes or {})
    assert attributes["pylon.admission.result"] == "accepted"
    queue = [attributes[f"pylon.queue.{name}_ms"] for name in ("expected", "actual", "threshold")]
    assert queue == [0, 0, 25]  # an idle engine, as Stargate expected; the 25 ms minimum delta
    assert (
        0 < attributes["engine.time_to_response_headers_ms"] <= attributes["engine.time_to_first_output_ms"]
    )
    assert (attributes["engine.status_code"], attributes["http.response.status_code"]) == (200, 200)
    assert attributes["pylon.request.state"] == "complete"


def status_of(span: ReadableSpan) -> object:
    return (span.attributes or {})["http.response.status_code"]


async def test_a_client_gone_before_the_first_byte_is_499_at_stargate_and_no_server_error_at_pylon(
    exported: Exported, engine: FakeEngine
) -> None:
    """Pylon's span said 500, an error, for every client hang-up."""
    engine.first_byte_delay_s = 30.0  # headers at once, then nothing: the client gives up
    async with traced_fleet(exported, engine) as url, aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5), http.post(url, data=CHAT, headers=HEADERS) as resp:
                await resp.read()
        await until("both spans ended", lambda: len(exported.exporter.get_finished_spans()) == 2)
    routed, relayed = exported.one("proxy_openai_request"), exported.one("pylon_request")
    assert (status_of(routed), status_of(relayed)) == (499, 200)  # Pylon had relayed the engine's head
    assert relayed.status.status_code is not StatusCode.ERROR


async def test_a_client_gone_mid_answer_is_the_status_it_got_on_stargates_span(
    exported: Exported, engine: FakeEngine
) -> None:
    """As the metrics count it (200, and a response cut by the client), not 499."""
    engine.end_gate = asyncio.Event()  # the stream never ends
    async with traced_fleet(exported, engine) as url, aiohttp.ClientSession() as http:
        async with http.post(url, data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            await resp.content.readany()
        await until("both spans ended", lambda: len(exported.exporter.get_finished_spans()) == 2)
    assert status_of(exported.one("proxy_openai_request")) == 200


async def test_a_request_refused_before_routing_has_its_span(exported: Exported, engine: FakeEngine) -> None:
    """One span per request: a 400 for a bad header had none, and the gateway's trace no child."""
    async with (
        traced_fleet(exported, engine) as url,
        aiohttp.ClientSession() as http,
        http.post(url, data=CHAT, headers={**HEADERS, "x-priority": "abc"}) as resp,
    ):
        assert resp.status == 400
    refused = exported.one("proxy_openai_request")
    assert (trace_id(refused), parent_id(refused), status_of(refused)) == (TRACE_ID, GATEWAY_SPAN, 400)
    assert (refused.attributes or {})["request.id"] == "r-traced"


def test_a_clients_tracestate_goes_only_with_its_own_trace(exported: Exported) -> None:
    """An orphan tracestate (no traceparent) went on beside the new trace's traceparent."""
    tracing = exported.tracing("stargate")
    carrier = {"tracestate": "vendor=abc"}
    span = tracing.start("s", carrier, {})
    tracing.inject(span, carrier)
    assert set(carrier) == {"traceparent"} and carrier["traceparent"].split("-")[1] != TRACE_ID
    carrier = {**GATEWAY, "tracestate": "vendor=abc"}
    span = tracing.start("s", carrier, {})
    tracing.inject(span, carrier)
    assert carrier["tracestate"] == "vendor=abc" and carrier["traceparent"].split("-")[1] == TRACE_ID


async def test_stargate_span_records_attempts_retry_reasons_and_the_chosen_backend(
    exported: Exported,
) -> None:
    server = StargateServer(settings(), tracing=exported.tracing("stargate"))
    busy = ScriptedBackend("busy", [rejection("queue_estimate_mismatch")])
    free = ScriptedBackend("free", [Reply()])
    try:
        bound = await server.start()
        async with aio.insecure_channel(bound.grpc) as channel, aiohttp.ClientSession() as http:
            stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)
            calls = []
            for backend, tps in ((busy, 1_000_000.0), (free, 1.0)):  # "busy" ranks first
                await backend.start()
                call = stub.RegisterInferenceServer(timeout=30)
                await call.write(registration(backend, last_mean_input_tps=tps))
                await asyncio.wait_for(call.read(), 10)
                calls.append(call)
            headers = {**HEADERS, "x-model": "m"}
            async with http.post(
                f"http://{bound.http}/v1/chat/completions", data=b"{}", headers=headers
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-inference-server-id"] == "free"
                await resp.read()
            for call in calls:
                call.cancel()
    finally:  # the channel's calls end with it; servers stop also when the test failed
        await busy.stop()
        await free.stop()
        await server.shutdown(drain_timeout_s=1.0)
    attributes = dict(exported.one("proxy_openai_request").attributes or {})
    assert attributes["proxy.attempt"] == 2
    assert attributes["routing.retry_attempts"] == 1
    assert attributes["proxy.retry_reason"] == ("queue_estimate_mismatch",)
    assert attributes["selected_inst.id"] == "free"
    assert busy.requests[0][1]["traceparent"].split("-")[1] == TRACE_ID


def test_tracing_is_off_without_an_endpoint_and_exports_to_the_traces_path() -> None:
    assert setup_tracing(None, "stargate") is None
    assert setup_tracing("  ", "stargate") is None
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    tracing = setup_tracing("http://127.0.0.1:9", "stargate")
    assert tracing is not None
    tracing.shutdown()


@pytest.mark.parametrize("endpoint", ["collector:4318", "grpc://127.0.0.1:4317", "http://"])
def test_an_endpoint_that_is_no_http_url_is_a_config_error_naming_the_flag(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"--otel-endpoint: expected an http:// or https:// URL"):
        setup_tracing(endpoint, "pylon")


def test_without_tracing_no_opentelemetry_module_is_loaded() -> None:
    code = (
        "import sys, stargate.router.cli, stargate.pylon.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'stargate.otel'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_shutdown_waits_for_the_collector_only_so_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collector that is down held a drained router for 10-20 s of export timeouts."""
    released = threading.Event()

    class Stuck(SimpleSpanProcessor):
        def shutdown(self) -> None:
            released.wait()  # an export that never answers

    monkeypatch.setattr(otel, "SHUTDOWN_TIMEOUT_S", 0.05)
    tracing = Tracing("stargate", Stuck(InMemorySpanExporter()))
    try:
        started = time.monotonic()
        tracing.shutdown()  # before, it waited for the export (the test timed out)
        assert time.monotonic() - started < 1.0
    finally:
        released.set()


def test_shutdown_flushes_the_spans_still_buffered() -> None:
    """Spans still in the batch when a process stops are its last requests: they must go out."""
    exporter = InMemorySpanExporter()
    tracing = Tracing("stargate", BatchSpanProcessor(exporter, schedule_delay_millis=60_000))
    tracing.end(tracing.start("last", {}, {}), 200, {})
    assert exporter.get_finished_spans() == ()  # still buffered
    tracing.shutdown()
    assert [s.name for s in exporter.get_finished_spans()] == ["last"]
