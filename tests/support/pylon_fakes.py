"""Fakes for Pylon tests: an aiohttp engine, a grpc.aio Stargate, and helpers that start real processes."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from aiohttp import web
from multidict import CIMultiDict

from stargate.proto import stargate_pb2, stargate_pb2_grpc
from support.waiting import until


@dataclass
class FakeEngine:
    models: list[str] = field(default_factory=lambda: ["llama"])
    models_status: int = 200  # with models_body: replaces the /v1/models answer
    models_body: bytes | None = None
    health_status: dict[str, int] = field(default_factory=lambda: {"/health": 200, "/v1/health/ready": 200})
    chat_mode: str = "ok"  # ok | hang | silent (no headers) | no_output | status | events
    events: list[bytes] = field(default_factory=list)  # the stream of chat_mode "events", as written
    chat_status: int = 200
    chat_headers: dict[str, str] = field(default_factory=dict)
    stream_status: int = 404
    stream_lines: list[bytes] = field(default_factory=list)
    calibration_status: int = 200
    hold_canaries: bool = False  # canaries wait unanswered, as behind a saturated engine's queue
    first_byte_delay_s: float = 0.0  # a stream's headers at once, its first byte this much later
    end_gate: asyncio.Event | None = None  # when set: a stream's end waits for it, after [DONE] (uvicorn's)
    requests: list[tuple[str, str, CIMultiDict[str], bytes]] = field(default_factory=list)
    url: str = ""
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # a caller hung up on a request
    _runner: web.AppRunner | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    def hits(self, path: str) -> int:
        return sum(1 for _, p, _, _ in self.requests if p == path)

    async def _health(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.raw_path, CIMultiDict(request.headers), b""))
        return web.Response(status=self.health_status.get(request.path, 404))

    async def _models(self, request: web.Request) -> web.Response:
        if self.models_status != 200 or self.models_body is not None:
            return web.Response(status=self.models_status, body=self.models_body or b"{}")
        return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.method, request.raw_path, CIMultiDict(request.headers), body))
        obj = orjson.loads(body)
        if self.hold_canaries and request.headers.get("x-request-id", "").startswith("canary-"):
            await self._hold()
        if not obj.get("stream"):
            await asyncio.sleep(0.015)
            if (
                request.headers.get("x-request-id", "").startswith("calibration-")
                and self.calibration_status != 200
            ):
                return web.json_response({"error": {"message": "boom"}}, status=self.calibration_status)
            return web.json_response({"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 1}})
        if self.chat_mode == "status":
            return web.json_response({"error": "busy"}, status=self.chat_status, headers=self.chat_headers)
        if self.chat_mode == "silent":
            try:
                await self._hold()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if self.first_byte_delay_s:
            await asyncio.sleep(self.first_byte_delay_s)  # queued and prefilling
        if self.chat_mode == "hang":
            await resp.write(b": keepalive\n\n")
            await self._hold()
        if self.chat_mode == "no_output":
            await resp.write(b": keepalive\n\n")
            return resp
        if self.chat_mode == "events":
            for event in self.events:
                await resp.write(event)
            await resp.write_eof()
            return resp
        for piece in ("a", "b", "c"):
            await resp.write(b'data: {"choices":[{"delta":{"content":"%s"}}]}\n\n' % piece.encode())
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        if self.end_gate is not None:
            await asyncio.wait_for(self.end_gate.wait(), 10)
        await resp.write_eof()
        return resp

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append((request.method, request.path, CIMultiDict(request.headers), body))
        return web.json_response({"data": [{"embedding": [0.1]}]})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if self.stream_status != 200:
            return web.Response(status=self.stream_status)
        resp = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        await resp.prepare(request)
        for line in self.stream_lines:
            await resp.write(line + b"\n")
        await self._hold()
        return resp

    async def _hold(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), 30)

    async def start(self) -> FakeEngine:
        self._closing = asyncio.Event()
        app = web.Application()
        for path in ("/health", "/v1/health/ready", "/ping"):
            app.router.add_get(path, self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/pylon/v1/stats/stream", self._stream)
        self._runner = web.AppRunner(
            app, handle_signals=False, auto_decompress=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()


class FakeStargate(stargate_pb2_grpc.StargateControlPlaneServicer):
    def __init__(self) -> None:
        self.watch_calls = 0
        self.register_calls = 0
        self.messages: list[stargate_pb2.InferenceServerRegistration] = []
        self.metadata: list[dict[str, str]] = []
        self.address = ""
        self.got_message = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        # Fault knobs: extra watch URLs announced, peers listed (id = address, as DNS peers are),
        # watch streams ended after their snapshot, registration calls refused before any ack,
        # registration streams ended after one ack.
        self.watch_urls: list[str] = []
        self.peers: list[str] = []
        self.end_watches = 0
        self.refuse_registrations = 0
        self.end_registrations = 0
        self.silent_registrations = 0  # streams that read on but ack nothing after their first ack
        self.register_times: list[float] = []
        self.watch_times: list[float] = []

    async def WatchStargates(
        self, request: Any, context: Any
    ) -> AsyncIterator[stargate_pb2.WatchStargatesResponse]:
        self.watch_calls += 1
        self.watch_times.append(asyncio.get_running_loop().time())
        yield stargate_pb2.WatchStargatesResponse(
            stargates=[
                stargate_pb2.StargateInfo(stargate_id="sg-1", advertise_addr=self.address),
                *(stargate_pb2.StargateInfo(stargate_id=peer, advertise_addr=peer) for peer in self.peers),
            ],
            watch_stargate_urls=self.watch_urls,
        )
        if self.end_watches > 0:
            self.end_watches -= 1
            return
        await asyncio.sleep(3600)

    async def RegisterInferenceServer(
        self, request_iterator: Any, context: Any
    ) -> AsyncIterator[stargate_pb2.InferenceServerAck]:
        self.register_calls += 1
        self.register_times.append(asyncio.get_running_loop().time())
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        if self.refuse_registrations > 0:
            self.refuse_registrations -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not yet")
        silent, acked = self.silent_registrations > 0, False
        self.silent_registrations -= silent
        async for msg in request_iterator:
            self.messages.append(msg)
            self.got_message.set()
            if silent and acked:
                continue
            yield stargate_pb2.InferenceServerAck()
            acked = True
            if self.end_registrations > 0:
                self.end_registrations -= 1
                return

    async def start(self) -> FakeStargate:
        self._server = grpc.aio.server()
        stargate_pb2_grpc.add_StargateControlPlaneServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self._server.start()
        return self

    async def wait_messages(self, n: int, timeout: float = 10.0) -> None:
        await until(f"{n} registration messages", lambda: len(self.messages) >= n, timeout_s=timeout)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(0)


MOCK_LINE = "stargate-mock-engine listening on "


async def spawn(*args: str) -> asyncio.subprocess.Process:
    """``python -m <args>`` with stdout piped (for its ready line) and stderr dropped."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )


async def read_line(proc: asyncio.subprocess.Process, prefix: str) -> str:
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        if not line:
            raise AssertionError(f"process exited before printing {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix) :].strip()


def pylon_args(engine_url: str, stargate_address: str, *extra: str) -> tuple[str, ...]:
    """``spawn`` arguments of a Pylon for model ``llama`` on loopback ephemeral ports."""
    return (
        "stargate.pylon.cli",
        "--upstream-http-base-url", engine_url,
        "--stargate-address", stargate_address,
        "--http-listen-addr", "127.0.0.1:0",
        "--metrics-host", "127.0.0.1",
        "--metrics-port", "0",
        "--model-name", "llama",
        *extra,
    )  # fmt: skip
