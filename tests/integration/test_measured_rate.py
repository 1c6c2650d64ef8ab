"""Stargate measures a cluster's prefill rate from the requests it proxies (lb-config
``prefill_rate: measured`` ranks with it), whatever Pylon publishes.

Real processes: one Stargate, a Pylon whose published input throughput is pinned at 100 tokens/s,
and a mock engine that prefills 2000 tokens/s. After three 1000-token prompts (about 1.5 s of
prefill) ``/debug/routing`` shows a measured rate of the engine's order while the published one
stays at the pin. The bounds are loose: a loaded machine adds latency, which reads as a lower rate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.one_backend import MODEL, READY_TIMEOUT_S, Fleet, one_backend, recommended_with
from support.waiting import until


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    engine = ["--max-concurrent-requests", "8", "--token-delay-ms", "5", "--num-tokens", "1",
              "--batching", "continuous", "--prefill-tokens-per-s", "2000"]  # fmt: skip
    pylon = ["--initial-input-tps", "100", "--benchmark-pin-input-tps", "--max-engine-concurrency", "8"]
    async with one_backend(tmp_path, recommended_with(prefill_rate="measured"), engine, pylon) as fleet:
        yield fleet


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


async def test_the_router_measures_the_engines_prefill_rate_not_the_pinned_one(
    fleet: Fleet, http: aiohttp.ClientSession
) -> None:
    async def routable() -> bool:
        return await fleet.cluster(http) is not None

    await until("a routable backend", routable, timeout_s=READY_TIMEOUT_S)
    assert (await fleet.cluster(http) or {})["measured_input_tps"] == 0.0
    for turn in range(3):
        headers = {"x-request-id": f"turn-{turn}", "x-model": MODEL, "x-input-tokens": "1000",
                   "x-output-tokens": "1"}  # fmt: skip
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        url = f"http://{fleet.stargate.http}/v1/chat/completions"
        async with http.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    cluster = await fleet.cluster(http)
    assert cluster is not None
    assert cluster["stats"]["last_mean_input_tps"] == 100.0
    assert 400.0 < cluster["measured_input_tps"] <= 2500.0, cluster
