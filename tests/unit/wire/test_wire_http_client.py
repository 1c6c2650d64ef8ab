"""Client sessions keep no cookies: Pylon and Stargate forward many clients' requests over one."""

from __future__ import annotations

import pytest
from aiohttp import web
from support.loopback import serving

from stargate.wire.http_client import client_session


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
