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
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.waiting import until

from stargate.bench.fleet import (
    StargateAddrs,
    command,
    parse_engine_ready,
    parse_pylon_ready,
    parse_stargate_ready,
)
from stargate.bench.procs import ManagedProcess, stop_all

MODEL = "llama"
READY_TIMEOUT_S = 20.0
RECOMMENDED = Path(__file__).resolve().parents[2] / "examples" / "lb-config" / "recommended.json"


async def _fleet(tmp_path: Path, await_prefill: bool) -> tuple[list[ManagedProcess[Any]], StargateAddrs, str]:
    config = json.loads(RECOMMENDED.read_text())
    (settings,) = config["models"].values()
    config["models"] = {MODEL: {**settings, "cache_affinity_await_prefill": await_prefill}}
    lb_config = tmp_path / "lb-config.json"
    lb_config.write_text(json.dumps(config))
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[Any]) -> Any:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    stargate = await launch(ManagedProcess("stargate", [
        *command("stargate"), "--stargate-id", "sg-0", "--listen-addr", "127.0.0.1:0",
        "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
        "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
        "--disable-dns-discovery", "--lb-config-path", str(lb_config),
    ], tmp_path, parse_stargate_ready))  # fmt: skip
    engine = await launch(ManagedProcess("engine", [
        *command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
        "--max-concurrent-requests", "8", "--token-delay-ms", "5", "--num-tokens", "1",
        "--kv-cache-mode", "affinity", "--kv-cache-capacity-tokens", "100000",
        "--batching", "continuous", "--prefill-tokens-per-s", "2000",
    ], tmp_path, parse_engine_ready))  # fmt: skip
    await launch(ManagedProcess("pylon", [
        *command("pylon"), "--upstream-http-base-url", engine, "--stargate-address", stargate.grpc,
        "--inference-server-id", "pylon-a", "--http-listen-addr", "127.0.0.1:0",
        "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--model-name", MODEL,
        "--initial-input-tps", "2000", "--max-engine-concurrency", "8",
        "--stats-update-coalesce-ms", "10"], tmp_path, parse_pylon_ready))  # fmt: skip
    return procs, stargate, engine


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


async def _in_flight(http: aiohttp.ClientSession, stargate: StargateAddrs) -> int | None:
    async with http.get(f"http://{stargate.http}/debug/routing") as resp:
        body = await resp.json()
    clusters = [c for t in body["targets"] if t["model_id"] == MODEL for c in t["clusters"]]
    return clusters[0]["in_flight"]["requests"] if clusters else None


async def _send(http: aiohttp.ClientSession, stargate: StargateAddrs, request_id: str, tokens: int) -> None:
    headers = {"x-request-id": request_id, "x-model": MODEL, "x-input-tokens": str(tokens),
               "x-output-tokens": "1", "x-cache-affinity-key": "session-1"}  # fmt: skip
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    async with http.post(f"http://{stargate.http}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


@pytest.mark.parametrize(("await_prefill", "hits"), [(True, 1), (False, 0)])
async def test_the_second_request_of_a_key_finds_the_first_ones_prefix_cached(
    tmp_path: Path, http: aiohttp.ClientSession, await_prefill: bool, hits: int
) -> None:
    procs, stargate, engine = await _fleet(tmp_path, await_prefill)
    tasks: list[asyncio.Task[None]] = []
    try:
        await until("a routable backend", lambda: _routable(http, stargate), timeout_s=READY_TIMEOUT_S)
        async with http.post(f"{engine}/test-control/pause") as resp:
            assert resp.status == 200
        tasks.append(asyncio.create_task(_send(http, stargate, "turn-1", 2000)))
        await until("the first turn in flight", lambda: _count_is(http, stargate, 1))
        tasks.append(asyncio.create_task(_send(http, stargate, "turn-2", 2100)))
        if not await_prefill:
            await until("both turns at the engine", lambda: _count_is(http, stargate, 2))
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
        await stop_all(procs, grace_s=3.0)


async def _routable(http: aiohttp.ClientSession, stargate: StargateAddrs) -> bool:
    return await _in_flight(http, stargate) is not None


async def _count_is(http: aiohttp.ClientSession, stargate: StargateAddrs, count: int) -> bool:
    return await _in_flight(http, stargate) == count
