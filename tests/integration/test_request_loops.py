"""A backend URL that leads back to a router: the router names itself in ``Via`` on every request
and health probe it sends, refuses what comes back with it, and keeps such a backend out of routing
(one request once became about a thousand, each a hop through the same router)."""

from __future__ import annotations

import logging

import orjson
import pytest
from support.stargate_harness import MODEL, ScriptedBackend, registration, running
from support.waiting import until

from stargate.router.health import HealthSettings
from stargate.router.plain_client import PlainClientSettings


async def test_forwarded_requests_name_the_router_after_the_hops_before_it() -> None:
    async with running() as sg:
        backend = await sg.backend("b1")
        status, _, _ = await sg.post({"via": "1.1 gateway"})
        assert status == 200
        assert backend.requests[0][1]["via"] == f"1.1 gateway, 1.1 {sg.server.via}"


async def test_a_request_that_passed_this_router_is_refused_retryable_before_routing() -> None:
    async with running() as sg:
        backend = await sg.backend("b1")
        status, headers, body = await sg.post({"via": f"1.0 edge, 1.1 {sg.server.via} (stargate)"})
        assert status == 503
        assert headers["x-stargate-retryable"] == "true"  # the router that sent it tries another backend
        assert headers["x-stargate-retry-reason"] == "request_loop"
        assert "leads to a router" in orjson.loads(body)["error"]["message"]
        assert backend.requests == []
        assert sg.metric("stargate_requests_total", routing_key="", model=MODEL,
                         inference_server_id="", status="503") == 0  # fmt: skip
        # another router's name is no loop
        status, _, _ = await sg.post({"via": "1.1 stargate-0123456789ab"})
        assert status == 200


async def test_a_via_with_no_room_left_for_the_routers_entry_is_refused() -> None:
    """An 8 KB Via passed the router's limit, and the next hop refused it with the entry added."""
    async with running() as sg:
        backend = await sg.backend("b1")
        status, _, body = await sg.post({"via": "1.1 " + "g" * 4100})
        assert status == 400 and b"via header is longer than 4096 characters" in body
        assert backend.requests == []


async def test_a_backend_registered_at_the_routers_own_url_never_enters_routing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "stargate.router.health")
    health = HealthSettings(interval_s=0.05, recheck_s=0.05)
    async with running(plain_clients=PlainClientSettings(), health=health) as sg:
        itself = ScriptedBackend("itself")
        itself.url = sg.base  # a Pylon URL pointing at the router (its plain-client /health answers)
        await sg.register(registration(itself))
        await until("a probe came back", lambda: "leads back to this router" in caplog.text)
        status, _, _ = await sg.post()
        assert status == 503  # no backend to route to, and no hop through the router itself
        assert sg.metric("stargate_proxy_attempts_total", routing_key="", model=MODEL,
                         inference_server_id="itself", result="upstream_503") == 0  # fmt: skip
        lines = [r for r in caplog.records if "leads back" in r.getMessage()]
        assert len(lines) == 1 and sg.base in lines[0].getMessage()
