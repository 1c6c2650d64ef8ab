"""A saturated engine answers canaries late: while it answers requests the model stays ACTIVE.

A real Pylon with its canaries on (every 100 ms, 500 ms timeout, so a pause of the test's own event
loop does not read as an engine that stopped answering) in front of a fake engine that leaves
canaries unanswered, as a saturated engine leaves them in its queue. Counted as failures, every
engine of a saturated fleet went INACTIVE at once and the routers answered 503.
"""

from __future__ import annotations

import asyncio
import io

import aiohttp
import orjson
from support.pylon_fakes import FakeEngine
from support.waiting import until

from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings
from stargate.pylon.models import ModelStatus

CHAT = orjson.dumps({"model": "llama", "messages": [], "stream": True})
HEADERS = {"x-model": "llama", "x-input-tokens": "10", "content-type": "application/json"}


def status(app: PylonApp) -> ModelStatus:
    ((_, model_status),) = app.registry.published()
    return model_status


def canaries_sent(engine: FakeEngine) -> int:
    ids = (headers.get("x-request-id", "") for _, _, headers, _ in engine.requests)
    return sum(1 for request_id in ids if request_id.startswith("canary-"))


async def test_late_canaries_fail_only_once_the_engine_stops_answering_requests(engine: FakeEngine) -> None:
    settings = parse_settings(
        [
            "--upstream-http-base-url", engine.url,
            "--stargate-address", "127.0.0.1:9",
            "--metrics-port", "0", "--metrics-host", "127.0.0.1",
            "--model-name", "llama",
            "--engine-stats-stream", "off",
            "--active-canary-interval-ms", "100",
            "--bringup-canary-timeout-ms", "500",
        ]
    )  # fmt: skip
    app = PylonApp(settings, out=io.StringIO())
    stop = asyncio.Event()

    async def traffic(session: aiohttp.ClientSession) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            headers = {**HEADERS, "x-request-id": f"r{n}"}
            url = app.http_url + "/v1/chat/completions"
            async with session.post(url, data=CHAT, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()

    try:
        await app.start()
        await until("the model ACTIVE", lambda: status(app) is ModelStatus.ACTIVE)
        engine.hold_canaries = True
        async with aiohttp.ClientSession() as session:
            sender = asyncio.create_task(traffic(session))
            try:
                sent = canaries_sent(engine)
                await until("four canaries left unanswered", lambda: canaries_sent(engine) >= sent + 4)
                assert status(app) is ModelStatus.ACTIVE  # late behind answered requests, not failed
            finally:
                stop.set()
                await sender
        await until("INACTIVE once nothing is answered", lambda: status(app) is ModelStatus.INACTIVE)
    finally:
        await app.close()
