"""Response headers, and a body's first byte, from a backend still in routing are waited for past
``--quic-request-timeout-ms``.

An engine sends a non-streamed answer's headers with its end, and a streamed one's first byte after
the request's queue wait and prefill; a real loopback server stands in for one that takes several
timeout periods to answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from support.loopback import serving
from support.waiting import until

from stargate.errors import UpstreamError, UpstreamTimeout
from stargate.router.clusters import Backend
from stargate.router.transport import HttpTransport


class SlowBackend:
    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.url = ""

    async def handle(self, _request: web.Request) -> web.Response:
        await asyncio.wait_for(self.release.wait(), 10)
        return web.Response(text="whole answer")

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)  # headers at once, as vLLM streams
        await asyncio.wait_for(self.release.wait(), 10)
        await response.write(b"first token")
        await response.write_eof()
        return response

    async def stream_then_hang(self, request: web.Request) -> web.StreamResponse:
        """A token, then nothing until released (a Pylon frozen mid-answer), then the rest."""
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first token")
        await asyncio.wait_for(self.release.wait(), 10)
        await response.write(b", the rest")
        await response.write_eof()
        return response


@pytest.fixture
async def backend() -> AsyncIterator[SlowBackend]:
    slow = SlowBackend()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", slow.handle)
    app.router.add_post("/v1/responses", slow.stream)
    app.router.add_post("/v1/completions", slow.stream_then_hang)
    async with serving(app) as slow.url:
        yield slow
        slow.release.set()


class Routing:
    """The router's answer to "is this backend, at this URL, still in routing?", and who asked."""

    def __init__(self) -> None:
        self.in_routing = True
        self.asked: list[tuple[str, str]] = []

    def __call__(self, backend_id: str, url: str) -> bool:  # asked once per period without an answer
        self.asked.append((backend_id, url))
        return self.in_routing


async def send(transport: HttpTransport, backend: SlowBackend, path: str = "/v1/chat/completions") -> str:
    ref = Backend("b1", backend.url, "c1")
    response = await transport.send(ref, "POST", path, CIMultiDict(), b"{}")
    try:
        return b"".join([chunk async for chunk in response.chunks()]).decode()
    finally:
        response.release()


async def test_a_backend_in_routing_is_waited_for_and_one_that_left_is_not(backend: SlowBackend) -> None:
    routing = Routing()
    async with aiohttp.ClientSession() as session:
        transport = HttpTransport(session, connect_timeout_s=1.0, request_timeout_s=0.05, alive=routing)
        answer = asyncio.create_task(send(transport, backend))
        await until("three periods without headers", lambda: len(routing.asked) >= 3)
        backend.release.set()
        assert await answer == "whole answer"
        assert set(routing.asked) == {("b1", backend.url)}  # this registration, not just its id

        backend.release.clear()
        routing.in_routing = False  # ejected by its health probes meanwhile: the spec's timeout applies
        routing.asked.clear()
        with pytest.raises(UpstreamTimeout, match=r"no response headers within 0\.05 s"):
            await send(transport, backend)
        assert routing.asked == [("b1", backend.url)]


@pytest.mark.parametrize(
    ("path", "answer", "cut"),
    [
        # Headers at once and the first byte late (a queued prompt), or hung after the headers.
        ("/v1/responses", "first token", r"sent no body byte within 0\.05 s and left routing"),
        # A long pause between tokens (a long generation), or frozen mid-answer.
        ("/v1/completions", "first token, the rest", r"sent nothing for [\d.]+ s mid-body and left routing"),
    ],
)
async def test_a_silent_body_is_waited_for_in_routing_and_ends_once_its_backend_left(
    backend: SlowBackend, path: str, answer: str, cut: str
) -> None:
    routing = Routing()
    async with aiohttp.ClientSession() as session:
        transport = HttpTransport(session, connect_timeout_s=1.0, request_timeout_s=0.05, alive=routing)
        sent = asyncio.create_task(send(transport, backend, path))
        await until("three silent periods", lambda: len(routing.asked) >= 3)
        backend.release.set()
        assert await sent == answer

        backend.release.clear()
        routing.in_routing = False  # ejected by its health probes meanwhile
        with pytest.raises(UpstreamError, match=cut):
            await send(transport, backend, path)
