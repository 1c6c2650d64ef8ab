"""A real Stargate on loopback with scripted aiohttp backends registered over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import aiohttp
from aiohttp import web
from grpc import aio
from yarl import URL

from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc
from stargate.router.app import StargateServer, StargateSettings
from stargate.router.health import HealthSettings
from stargate.wire.client_faults import ClientFaults

MODEL = "m"
CHAT = "/v1/chat/completions"
SSE_CHUNKS = (b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n")
HEADERS = {"x-request-id": "req-1", "x-model": MODEL, "x-input-tokens": "10"}
TIMEOUT = aiohttp.ClientTimeout(total=15)
CLIENT_SKIPS = ("Accept-Encoding", "User-Agent")


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def rejection(reason: str, status: int = 429) -> Reply:
    return Reply(status, {"x-stargate-retryable": "true", "x-stargate-retry-reason": reason}, b"busy")


@dataclass
class ScriptedBackend:
    """A backend answering /health and the proxied paths; replies are scripted (last one repeats)."""

    name: str
    script: list[Reply] = field(default_factory=list)
    by_model: dict[str, Reply] = field(default_factory=dict)  # the reply to every request for a model
    gate: asyncio.Event | None = None  # when set: hold the stream after the first SSE chunk
    chunks: tuple[bytes, ...] = SSE_CHUNKS
    abort_after_first: bool = False  # drop the connection mid-stream
    abort_before_answer: bool = False  # read the request, then drop the connection unanswered
    hold_headers: asyncio.Event | None = None  # when set: wait for it before answering at all
    hold_health: asyncio.Event | None = None  # when set: /health waits for it (a frozen backend)
    health_checks: int = 0  # /health requests answered
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set once a request was read
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # set when a caller hung up on one
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def health(self, request: web.Request) -> web.Response:
        if self.hold_health is not None:
            await asyncio.wait_for(self.hold_health.wait(), 10)
        self.health_checks += 1
        return web.Response(text="ok")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._answer(request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.raw_path, {k.lower(): v for k, v in request.headers.items()}, body))
        self.arrived.set()
        if self.abort_before_answer and request.transport is not None:
            request.transport.abort()
            return web.Response()
        if self.hold_headers is not None:
            await asyncio.wait_for(self.hold_headers.wait(), 10)
        reply = (self.script.pop(0) if len(self.script) > 1 else self.script[0]) if self.script else None
        reply = self.by_model.get(request.headers.get("x-model", ""), reply)
        if reply is not None and reply.status != 200:
            return web.Response(status=reply.status, headers=reply.headers, body=reply.body)
        response = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "x-upstream-header": "u",
                "x-stargate-retry-reason": "leak",
                **(reply.headers if reply else {}),
            }
        )
        await response.prepare(request)
        for i, chunk in enumerate(self.chunks):
            await response.write(chunk)
            if i == 0 and self.abort_after_first and request.transport is not None:
                request.transport.abort()
                return response
            if i == 0 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 10)
        await response.write_eof()
        return response

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        for path in (CHAT, "/v1/responses", "/v1/embeddings"):
            app.router.add_post(path, self.handle)
        self.runner = web.AppRunner(
            app, shutdown_timeout=0.5, auto_decompress=False, handler_cancellation=True
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def registration(
    backend: ScriptedBackend,
    cluster_id: str = "",
    status: int = pb.INFERENCE_SERVER_STATUS_ACTIVE,
    models: tuple[str, ...] = (MODEL,),
    **stats: float,
) -> pb.InferenceServerRegistration:
    message = pb.InferenceServerRegistration(
        inference_server_id=backend.name, inference_server_url=backend.url, cluster_id=cluster_id
    )
    tps = stats.pop("last_mean_input_tps", 1000.0)
    for model_id in models:
        entry = message.models[model_id]
        entry.status = status  # type: ignore[assignment]
        entry.stats.CopyFrom(pb.ModelStats(last_mean_input_tps=tps, **stats))
    return message


@dataclass
class Harness:
    server: StargateServer
    http: aiohttp.ClientSession
    stub: stargate_pb2_grpc.StargateControlPlaneStub
    discovery: stargate_pb2_grpc.StargateModelDiscoveryStub
    base: str
    calls: list[aio.StreamStreamCall] = field(default_factory=list)
    backends: list[ScriptedBackend] = field(default_factory=list)

    async def backend(
        self,
        name: str,
        *script: Reply,
        cluster_id: str = "",
        register: bool = True,
        models: tuple[str, ...] = (MODEL,),
        **stats: float,
    ) -> ScriptedBackend:
        backend = ScriptedBackend(name, list(script))
        await backend.start()
        self.backends.append(backend)
        if register:
            await self.register(registration(backend, cluster_id, models=models, **stats))
        return backend

    async def register(self, message: pb.InferenceServerRegistration) -> aio.StreamStreamCall:
        call = self.stub.RegisterInferenceServer(timeout=30)
        await call.write(message)
        ack = await asyncio.wait_for(call.read(), 10)
        assert isinstance(ack, pb.InferenceServerAck)
        self.calls.append(call)
        return call

    async def post(
        self, headers: dict[str, str] | None = None, body: bytes | object = b"{}", path: str = CHAT
    ) -> tuple[int, dict[str, str], bytes]:
        url = URL(self.base + path, encoded=True)  # sent as written
        async with self.http.post(url, headers={**HEADERS, **(headers or {})}, data=body) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

    def metric(self, name: str, **labels: str) -> float:
        return self.server.metrics.registry.get_sample_value(name, labels) or 0.0


def settings(**overrides: object) -> StargateSettings:
    base = StargateSettings(
        stargate_id="sg-test",
        advertise_addr="127.0.0.1:0",
        listen_addr="127.0.0.1:0",
        model_discovery_listen_addr="127.0.0.1:0",
        http_listen_addr="127.0.0.1:0",
        metrics_host="127.0.0.1",
        metrics_port=0,
        disable_dns_discovery=True,
        health=HealthSettings(interval_s=30.0),
        connect_timeout_ms=1000,
        request_timeout_ms=5000,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running(client_faults: ClientFaults | None = None, **overrides: object) -> AsyncIterator[Harness]:
    server = StargateServer(settings(**overrides), client_faults=client_faults)
    try:  # shut down also when start fails part of the way
        bound = await server.start()
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT, skip_auto_headers=CLIENT_SKIPS) as http,
            aio.insecure_channel(bound.grpc) as channel,
        ):
            harness = Harness(
                server,
                http,
                stargate_pb2_grpc.StargateControlPlaneStub(channel),
                stargate_pb2_grpc.StargateModelDiscoveryStub(channel),
                f"http://{bound.http}",
            )
            try:
                yield harness
            finally:
                for call in harness.calls:
                    call.cancel()
                for backend in harness.backends:
                    await backend.stop()
    finally:
        await server.shutdown(drain_timeout_s=1.0)
