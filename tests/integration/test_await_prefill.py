"""A key's request waits in Stargate for the prefill of its predecessor on the same backend
(lb-config ``cache_affinity_await_prefill``), so it finds that prefix cached instead of prefilling
it again beside it.

Real processes: one Stargate with the recommended config (with and without the option), a mock
engine whose KV cache is keyed by ``x-cache-affinity-key`` (an in-flight request does not warm it),
and a Pylon. The engine is paused while both requests of the key arrive, so without the option
both reach it together and the second misses; with it the second is sent after the first's first
byte and hits, whatever the timing. The first prompt takes a second to prefill, so the second
request reaches the engine well before that prefill ends even on a loaded machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from support.one_backend import MODEL, READY_TIMEOUT_S, Fleet, one_backend, recommended_with
from support.waiting import until

ENGINE = ["--max-concurrent-requests", "8", "--token-delay-ms", "5", "--num-tokens", "1",
          "--kv-cache-mode", "affinity", "--kv-cache-capacity-tokens", "100000",
          "--batching", "continuous", "--prefill-tokens-per-s", "2000"]  # fmt: skip
PYLON = ["--initial-input-tps", "2000", "--max-engine-concurrency", "8", "--stats-update-coalesce-ms", "10"]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


async def _in_flight(http: aiohttp.ClientSession, fleet: Fleet) -> int | None:
    cluster = await fleet.cluster(http)
    return None if cluster is None else int(cluster["in_flight"]["requests"])


async def _send(http: aiohttp.ClientSession, fleet: Fleet, request_id: str, tokens: int) -> None:
    headers = {"x-request-id": request_id, "x-model": MODEL, "x-input-tokens": str(tokens),
               "x-output-tokens": "1", "x-cache-affinity-key": "session-1"}  # fmt: skip
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    url = f"http://{fleet.stargate.http}/v1/chat/completions"
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


@pytest.mark.parametrize(("await_prefill", "hits"), [(True, 1), (False, 0)])
async def test_the_second_request_of_a_key_finds_the_first_ones_prefix_cached(
    tmp_path: Path, http: aiohttp.ClientSession, await_prefill: bool, hits: int
) -> None:
    config = recommended_with(cache_affinity_await_prefill=await_prefill)
    tasks: list[asyncio.Task[None]] = []
    async with one_backend(tmp_path, config, ENGINE, PYLON) as fleet:
        engine = fleet.engine_url
        try:
            await until("a routable backend", lambda: _routable(http, fleet), timeout_s=READY_TIMEOUT_S)
            async with http.post(f"{engine}/test-control/pause") as resp:
                assert resp.status == 200
            tasks.append(asyncio.create_task(_send(http, fleet, "turn-1", 2000)))
            await until("the first turn in flight", lambda: _count_is(http, fleet, 1))
            tasks.append(asyncio.create_task(_send(http, fleet, "turn-2", 2100)))
            if not await_prefill:
                await until("both turns at the engine", lambda: _count_is(http, fleet, 2))
            async with http.post(f"{engine}/test-control/resume") as resp:
                assert resp.status == 200
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            async with http.get(f"{engine}/kv-cache/stats") as resp:
                stats = await resp.json()
            assert stats["kv_cache_hit_count"] == hits, stats
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _routable(http: aiohttp.ClientSession, fleet: Fleet) -> bool:
    return await _in_flight(http, fleet) is not None


async def _count_is(http: aiohttp.ClientSession, fleet: Fleet, count: int) -> bool:
    return await _in_flight(http, fleet) == count
