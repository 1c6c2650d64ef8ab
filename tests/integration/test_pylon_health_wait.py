"""Pylon's start-up health wait says which engine URL is not healthy and which flags change it."""

from __future__ import annotations

import logging
import socket

import aiohttp
import pytest

from stargate.pylon.health import HealthProber


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unhealthy_engine_is_named_at_once(caplog: pytest.LogCaptureFixture) -> None:
    base = f"http://127.0.0.1:{closed_port()}"
    async with aiohttp.ClientSession() as session:
        prober = HealthProber(session, base, ["/health", "/v1/health/ready"])
        with caplog.at_level(logging.WARNING, logger="stargate.pylon"):
            assert not await prober.wait_healthy(timeout_s=1.0, wait_ms=0)
    [record] = [r for r in caplog.records if "not healthy" in r.getMessage()]
    message = record.getMessage()
    assert base in message and "/health, /v1/health/ready" in message
    assert "--upstream-http-base-url" in message and "--upstream-health-wait-ms" in message
