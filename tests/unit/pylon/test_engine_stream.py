"""The engine stats stream's reconnect delay, and its wake-up once the engine answers."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from support.loopback import serving
from support.waiting import until

from stargate.pylon.config import StatsStreamMode
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.stats.engine_stream import EngineStatsStream
from stargate.wire.http_client import client_session

from .helpers import Rig, make_rig


def stats_reader(
    session: aiohttp.ClientSession, url: str, rig: Rig, metrics: PylonMetrics
) -> EngineStatsStream:
    """A reader of ``url``'s /stats whose next attempt, without a wake-up, is a minute away."""
    return EngineStatsStream(
        session=session,
        url=url + "/stats",
        mode=StatsStreamMode.REQUIRED,
        hub=rig.hub,
        metrics=metrics,
        backoff_start_s=60.0,
    )


async def test_wake_reconnects_at_once_and_starts_the_delays_over() -> None:
    """An engine that came up after its Pylon was read up to 5 s later (the delay had grown while
    it was down), and the Pylon published no concurrency limit meanwhile."""
    answers = [503, 503, 200]
    hits: list[int] = []

    async def stream(_request: web.Request) -> web.StreamResponse:
        status = answers[min(len(hits), len(answers) - 1)]
        hits.append(status)
        if status != 200:
            return web.Response(status=status)
        return web.Response(body=b'{"type":"ping","v":1,"model":"llama","max_engine_concurrency":7}\n')

    app = web.Application()
    app.router.add_get("/stats", stream)
    rig = make_rig()
    async with serving(app) as url, client_session(connect_timeout_s=5.0) as session:
        reader = stats_reader(session, url, rig, PylonMetrics())
        task = asyncio.create_task(reader.run())
        try:
            await until("a first attempt", lambda: len(hits) == 1)
            reader.wake()
            await until("a second attempt at once", lambda: len(hits) == 2)
            reader.wake()
            await until("the engine's limit", lambda: rig.hub.effective_limit(rig.gen) == 7)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_an_answer_outside_2xx_is_no_stream_even_with_a_body() -> None:
    """A 300 is a status to retry on, not events: its body is never read as the engine's."""
    hits: list[int] = []

    async def stream(_request: web.Request) -> web.StreamResponse:
        hits.append(1)
        status, limit = (300, 7) if len(hits) == 1 else (200, 3)
        body = b'{"type":"ping","v":1,"model":"llama","max_engine_concurrency":%d}\n' % limit
        return web.Response(status=status, body=body)

    app = web.Application()
    app.router.add_get("/stats", stream)
    rig = make_rig()
    metrics = PylonMetrics()
    async with serving(app) as url, client_session(connect_timeout_s=5.0) as session:
        reader = stats_reader(session, url, rig, metrics)
        task = asyncio.create_task(reader.run())
        try:
            await until("a first attempt", lambda: len(hits) == 1)
            reader.wake()
            await until("the engine's limit", lambda: rig.hub.effective_limit(rig.gen) == 3)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    get = metrics.registry.get_sample_value
    assert get("pylon_engine_stats_stream_events_total", {"type": "ping"}) == 1  # the 200's only
    assert get("pylon_engine_stats_stream_reconnects_total", {"reason": "http_status"}) == 1


async def test_a_failed_connection_names_its_cause_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """An engine whose TLS Pylon could not use was logged as a bare ``connect_error``."""

    async def stream(_request: web.Request) -> web.StreamResponse:
        return web.Response()

    app = web.Application()
    app.router.add_get("/stats", stream)
    rig = make_rig()
    metrics = PylonMetrics()
    async with serving(app) as url, client_session(connect_timeout_s=5.0) as session:
        reader = stats_reader(session, url.replace("http://", "https://"), rig, metrics)
        task = asyncio.create_task(reader.run())
        try:
            name, labels = "pylon_engine_stats_stream_reconnects_total", {"reason": "connect_error"}
            await until("a failed attempt", lambda: metrics.registry.get_sample_value(name, labels))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert "failed (connect_error: TLS: " in caplog.text, caplog.text
