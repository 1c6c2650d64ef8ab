from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from stargate.wire.listen import BACKLOG, listen


async def test_listeners_queue_thousands_of_connections_before_they_are_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    create_server = loop.create_server
    backlogs: list[int] = []

    async def recording(*args: Any, **kwargs: Any) -> Any:
        backlogs.append(kwargs["backlog"])
        return await create_server(*args, **kwargs)

    monkeypatch.setattr(loop, "create_server", recording)

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    port = await listen(runner, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/") as resp:
            assert await resp.text() == "ok"
    finally:
        await runner.cleanup()
    assert backlogs == [BACKLOG] and BACKLOG >= 4096  # aiohttp's own default is 128


async def test_a_listener_on_the_ipv6_any_address_takes_ipv4_too() -> None:
    """As the gRPC listeners on ``[::]`` do: asyncio alone made it IPv6-only."""
    if not socket.has_ipv6:
        pytest.skip("needs IPv6")

    async def hello(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    port = await listen(runner, "::", 0)
    try:
        async with aiohttp.ClientSession() as session:
            for host in ("127.0.0.1", "[::1]"):
                async with session.get(f"http://{host}:{port}/") as resp:
                    assert await resp.text() == "ok", host
    finally:
        await runner.cleanup()
