"""Client sessions keep no cookies (Pylon and Stargate forward many clients' requests over one) and
give up on a peer that stops acknowledging."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web
from support.loopback import serving

from stargate.wire.http_client import TCP_KEEPALIVE_IDLE_S, TCP_USER_TIMEOUT_S, client_session


@pytest.mark.parametrize("relay", [False, True])
async def test_a_cookie_an_engine_sets_is_not_sent_on_the_next_request(relay: bool) -> None:
    """An engine behind a host name set a cookie on one client's answer, and Pylon sent it on the
    next client's request (aiohttp keeps no cookie of an IP address, so 127.0.0.1 hid it)."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.Response(text="ok")
        response.set_cookie("who", f"client-{len(seen)}")
        return response

    app = web.Application()
    app.router.add_get("/", answer)
    async with serving(app) as url, client_session(connect_timeout_s=5.0, relay=relay) as session:
        named = url.replace("127.0.0.1", "localhost")
        for _ in range(2):
            async with session.get(named + "/") as resp:
                assert resp.status == 200
    assert seen == [None, None]


@pytest.mark.parametrize("relay", [False, True])
async def test_a_connection_fails_once_its_peer_stops_acknowledging(relay: bool) -> None:
    """A request sent on a connection whose packets were dropped waited for an answer as long as
    its backend stayed in routing, up to 30 minutes: the kernel now gives up on it."""

    done = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"a")
        await done.wait()  # the connection stays the response's while the test looks at it
        return response

    app = web.Application()
    app.router.add_get("/", answer)
    async with (
        serving(app) as url,
        client_session(connect_timeout_s=5.0, relay=relay) as session,
        session.get(url + "/") as resp,
    ):
        try:
            assert resp.connection is not None and resp.connection.transport is not None
            sock = resp.connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_USER_TIMEOUT"):
                timeout = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
                assert timeout == TCP_USER_TIMEOUT_S * 1000
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == TCP_KEEPALIVE_IDLE_S
        finally:
            done.set()
