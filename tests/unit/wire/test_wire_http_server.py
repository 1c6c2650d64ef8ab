"""The aiohttp internals ``GuardedRequestHandler`` reads: an aiohttp upgrade that renames one
fails here, by name, instead of silently switching a client deadline off."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from support.waiting import until

from stargate.wire import http_server
from stargate.wire.client_faults import ClientFaults
from stargate.wire.http_server import ClientTimeouts, GuardedAppRunner, GuardedRequestHandler


def test_the_aiohttp_connection_state_the_client_deadlines_read_exists() -> None:
    slots: set[str] = set()
    for cls in RequestHandler.__mro__:
        slots.update(getattr(cls, "__slots__", ()))
    needed = (
        "_waiter",
        "_messages",
        "_current_request",
        "_reading_paused",
        "_buffer_paused",
        "_lingering_time",
    )
    needed += ("_request_count", "_next_keepalive_close_time", "_keepalive_timeout")
    assert [name for name in needed if name not in slots] == []
    assert isinstance(RequestHandler.writing_paused, property)
    assert issubclass(GuardedRequestHandler, RequestHandler)


async def listening(
    app: web.Application, head_s: float = 0, host: str = "127.0.0.1", **kwargs: Any
) -> tuple[GuardedAppRunner, int]:
    """``app`` on a loopback port, its client faults logged on ``test.http_server``."""
    faults = ClientFaults(logging.getLogger("test.http_server"))
    runner = GuardedAppRunner(app, faults=faults, timeouts=ClientTimeouts(head_s, 0, 0), **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def served(problem: bool) -> tuple[web.AppRunner, str]:
    async def broken(_request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    app = web.Application()
    app.router.add_get("/", broken)
    runner, port = await listening(app, problem=problem)
    return runner, f"http://127.0.0.1:{port}/"


@pytest.mark.parametrize("problem", [False, True])
async def test_a_handler_that_raises_gets_the_json_error_body(problem: bool) -> None:
    runner, url = await served(problem)
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 500
            assert resp.content_type == ("application/problem+json" if problem else "application/json")
            assert (await resp.json(content_type=None))["error"]["code"] == "internal_error"
    finally:
        await runner.cleanup()


async def test_an_ipv6_client_is_named_in_brackets(caplog: pytest.LogCaptureFixture) -> None:
    """``::1:41234`` reads as an address or as ``::1`` port 41234."""
    runner, port = await listening(web.Application(), host="::1")
    try:
        with caplog.at_level(logging.WARNING, logger="test.http_server"):
            reader, writer = await asyncio.open_connection("::1", port)
            writer.write(b"GARBAGE /\x00 HTTP/1.1\r\n\r\n")
            await asyncio.wait_for(reader.read(), 5)
            writer.close()
            await until("the warning", lambda: bool(caplog.records))
        assert re.search(r"from \[::1\]:\d+", caplog.records[0].getMessage())
    finally:
        await runner.cleanup()


async def test_connections_near_the_open_file_limit_are_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Past the limit the event loop turns connections away without a word: warn before it."""
    runner, port = await listening(web.Application(), open_files=10)
    writers = []
    try:
        with caplog.at_level(logging.WARNING, logger="test.http_server"):
            for _ in range(7):
                writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
            await until("seven connections accepted", lambda: len(runner.server.connections) == 7)  # type: ignore[union-attr]
            assert not caplog.records  # below 8 of 10
            writers.append((await asyncio.open_connection("127.0.0.1", port))[1])
            await until("the warning", lambda: bool(caplog.records))
        assert "8 client connections" in caplog.records[0].getMessage()
        assert "open-file limit is 10" in caplog.records[0].getMessage()
    finally:
        for writer in writers:
            writer.close()
        await runner.cleanup()


@pytest.mark.parametrize("idle_s", [0.0, 60.0])
async def test_a_crowded_listener_closes_its_idle_keepalive_connections(
    idle_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle keep-alives held by one client would turn every other client away for their 75 s;
    a connection sending a head or waiting for its answer is left alone, and so is one idle for
    less than ``SHED_IDLE_S`` (a pooled client may be sending on it)."""
    monkeypatch.setattr(http_server, "SHED_IDLE_S", idle_s)
    release = asyncio.Event()

    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(_request: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/", ok)
    app.router.add_get("/slow", slow)
    runner, port = await listening(app, head_s=60, open_files=10)
    server = runner.server
    assert server is not None
    streams = []
    try:
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
            streams.append((reader, writer))
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(b"GET / HTTP/1.1\r\nHo")
        waiting = await asyncio.open_connection("127.0.0.1", port)
        waiting[1].write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        streams += [partial, waiting]
        await until("seven connections accepted", lambda: len(server.connections) == 7)
        streams.append(await asyncio.open_connection("127.0.0.1", port))  # the 8th of 10
        if idle_s:  # closing happens as the 8th is accepted: none was
            await until("eight connections accepted", lambda: len(server.connections) == 8)
            assert all(c.transport is not None for c in server.connections)
        else:
            for reader, _ in streams[:5]:
                assert await asyncio.wait_for(reader.read(), 5) == b""
            await until("the idle ones gone", lambda: len(server.connections) == 3)
        release.set()
        assert (await waiting[0].readuntil(b"late")).startswith(b"HTTP/1.1 200")
    finally:
        for _, writer in streams:
            writer.close()
        await runner.cleanup()
