"""A real control plane (grpc.aio) with a real /health endpoint on loopback, stopped on the way out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from grpc import aio

from stargate.balancer.types import Target
from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc
from stargate.router.control_plane import ControlPlane, ControlPlaneSettings
from stargate.router.health import HealthSettings
from stargate.router.state import RoutingState
from stargate.wire.clock import Clock

T = Target(None, "model-a")
CALL_TIMEOUT_S = 10.0


@dataclass
class HealthServer:
    healthy: bool = True
    seen: list[dict[str, str]] = field(default_factory=list)
    url: str = ""
    probed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append({k.lower(): v for k, v in request.headers.items()})
        self.probed.set()
        return web.Response(text="ok") if self.healthy else web.Response(status=503)


@dataclass
class Harness:
    state: RoutingState
    plane: ControlPlane
    stub: stargate_pb2_grpc.StargateControlPlaneStub
    health: HealthServer
    session: aiohttp.ClientSession
    channel: aio.Channel | None = None

    def open(self, metadata: tuple[tuple[str, str], ...] = ()) -> aio.StreamStreamCall:
        return self.stub.RegisterInferenceServer(metadata=metadata, timeout=CALL_TIMEOUT_S)


class TokenAuthenticator:
    async def authenticate(self, token: str | None) -> str | None:
        if token == "bad":
            raise PermissionError("rejected")
        return None if token is None else f"rk-{token}"


@contextlib.asynccontextmanager
async def make_harness(clock: Clock | None = None, **overrides: object) -> AsyncIterator[Harness]:
    health = HealthServer()
    app = web.Application()
    app.router.add_get("/health", health.handle)
    values: dict[str, object] = {
        "stargate_id": "sg-1",
        "advertise_addr": "127.0.0.1:0",
        "http_advertise_addr": "127.0.0.1:8000",
        "health": HealthSettings(interval_s=60.0, timeout_s=2.0),
    }
    values.update(overrides)
    settings = ControlPlaneSettings(**values)  # type: ignore[arg-type]
    state = RoutingState()
    runner = web.AppRunner(app)
    await runner.setup()
    # Stopped in ``finally``, also when the test fails: a server left to the garbage collector
    # would fail a later test with an unraisable "Event loop is closed".
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        health.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with aiohttp.ClientSession() as session:
            plane = ControlPlane(state, settings, session, authenticator=TokenAuthenticator(), clock=clock)
            try:
                grpc_port, _ = await plane.start("127.0.0.1:0", "127.0.0.1:0")
                async with aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)
                    yield Harness(state, plane, stub, health, session, channel)
            finally:
                await plane.stop(0.5)
    finally:
        await runner.cleanup()


def message(
    url: str,
    *,
    server_id: str = "srv-1",
    status: int = pb.INFERENCE_SERVER_STATUS_ACTIVE,
    with_stats: bool = True,
    cluster_id: str = "",
    models: tuple[str, ...] = ("model-a",),
) -> pb.InferenceServerRegistration:
    registration = pb.InferenceServerRegistration(
        inference_server_id=server_id, inference_server_url=url, cluster_id=cluster_id
    )
    for model_id in models:
        entry = registration.models[model_id]
        entry.status = status  # type: ignore[assignment]
        if with_stats:
            entry.stats.last_mean_input_tps = 100.0
            entry.stats.queue_size = 2
    return registration


Registration = pb.InferenceServerRegistration


async def send(call: aio.StreamStreamCall, registration: Registration) -> pb.InferenceServerAck:
    await call.write(registration)
    ack = await call.read()
    assert isinstance(ack, pb.InferenceServerAck)
    return ack


async def rejected(call: aio.StreamStreamCall, registration: Registration) -> aio.AioRpcError:
    """The status that ends the stream after ``registration``."""
    await call.write(registration)
    with pytest.raises(aio.AioRpcError) as info:
        await call.read()
    return info.value
