"""A burst far past the slots, as ``stargate-bench serve`` runs it: no request is refused.

Real processes: the fleet of ``stargate-bench serve`` (the recommended deployment, four mock
engines of 16 slots, each behind a Pylon, plain-client mode). 400 streaming requests arrive at
once from a plain client; the routers may hold a request for 60 s (``--default-max-wait-ms``).

- One Stargate: each attempt tells Pylon the queue it should find, and under ``load_aware`` that
  counts the router's own requests in flight, so Pylon, counting the same requests, rejects
  almost none as ``queue_estimate_mismatch`` (0 in eight runs). From the published stats alone
  (a heartbeat behind) seven runs had 0 to 30 such rejections, and in some a request ran out of
  retries and its client got the 429.
- Two Stargates, each with half the burst: neither sees the other's requests before a heartbeat,
  so Pylon refuses hundreds of attempts; a request refused by every backend it tried is routed
  again and queued without an estimate instead of answered 429 (which 5-15 % of the burst got).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from stargate.bench.fleet import Fleet
from stargate.bench.serve import serve_run, serve_scenario

MODEL = "mock-model"
REQUESTS = 400


async def _send(http: aiohttp.ClientSession, url: str, index: int) -> int:
    prompt = f"t{index} " + "x" * (10 + index * 7919 % 20_000)
    body = {"model": MODEL, "stream": True, "max_tokens": 1 + index * 37 % 200,
            "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
    async with http.post(url, json=body) as resp:
        await resp.read()
        return resp.status


async def _mismatch_retries(http: aiohttp.ClientSession, metrics: str | None) -> float:
    assert metrics is not None
    async with http.get(f"http://{metrics}/metrics") as resp:
        text = await resp.text()
    pattern = r'^stargate_proxy_retries_total\{[^}]*reason="queue_estimate_mismatch"[^}]*\} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


@pytest.mark.parametrize("stargates", [1, 2])
async def test_a_burst_past_the_slots_is_served_whole(tmp_path: Path, stargates: int) -> None:
    scenario = serve_scenario(4, MODEL, 16)
    routers = scenario.stargates.model_copy(update={"count": stargates})
    scenario = scenario.model_copy(update={"stargates": routers})
    async with Fleet(scenario, serve_run(scenario, None, plain=True), tmp_path) as fleet:
        urls = [f"http://{stargate.http}/v1/chat/completions" for stargate in fleet.stargates]
        connector = aiohttp.TCPConnector(limit=0)  # all 400 at once, not aiohttp's 100
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            statuses = await asyncio.gather(*(_send(http, urls[i % stargates], i) for i in range(REQUESTS)))
            assert statuses == [200] * REQUESTS
            if stargates == 1:
                # Not one attempt in a hundred refused.
                assert await _mismatch_retries(http, fleet.stargates[0].metrics) < REQUESTS / 100
