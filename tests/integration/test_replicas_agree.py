"""Two Stargate replicas send a cache-affinity key to the same backend: each learns where the other
placed a key from the routes the Pylons publish (ModelStats field 18).

Real processes: two Stargates with the recommended config (a new key is placed by load), two mock
engines, two Pylons registered with both Stargates. A key's first request goes to one replica and
is still running when its second goes to the other: that replica sees the first backend busy and
the other idle, so alone it would place the key on the idle one; it must follow the key instead.
"""

from __future__ import annotations

import asyncio
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
KEYS = 4
READY_TIMEOUT_S = 20.0
RECOMMENDED = Path(__file__).resolve().parents[2] / "examples" / "lb-config" / "recommended.json"


def _stargate(index: int, tmp_path: Path, *seeds: str) -> ManagedProcess[StargateAddrs]:
    argv = [*command("stargate"), "--stargate-id", f"sg-{index}", "--listen-addr", "127.0.0.1:0",
            "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
            "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--disable-dns-discovery", "--lb-config-path", str(RECOMMENDED)]  # fmt: skip
    for seed in seeds:
        argv += ["--remote-stargate-url", seed]
    return ManagedProcess(f"stargate-{index}", argv, tmp_path, parse_stargate_ready)


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[list[StargateAddrs]]:
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[Any]) -> Any:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    def engine(name: str) -> ManagedProcess[str]:
        argv = [*command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
                "--max-concurrent-requests", "8", "--token-delay-ms", "10", "--num-tokens", "1"]  # fmt: skip
        return ManagedProcess(f"engine-{name}", argv, tmp_path, parse_engine_ready)

    try:
        # Pylons find sg-1 through sg-0, which announces it as a remote watch URL.
        second = await launch(_stargate(1, tmp_path))
        first, engine_a, engine_b = await asyncio.gather(
            launch(_stargate(0, tmp_path, f"http://{second.grpc}")), launch(engine("a")), launch(engine("b"))
        )
        for name, url in (("a", engine_a), ("b", engine_b)):
            await launch(ManagedProcess(f"pylon-{name}", [
                *command("pylon"), "--upstream-http-base-url", url, "--stargate-address", first.grpc,
                "--inference-server-id", f"pylon-{name}", "--cluster-id", f"cluster-{name}",
                "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
                "--model-name", MODEL, "--initial-input-tps", "5000", "--max-engine-concurrency", "8",
                "--stats-update-coalesce-ms", "10"], tmp_path, parse_pylon_ready))  # fmt: skip
        yield [first, second]
    finally:
        await stop_all(procs, grace_s=3.0)


async def _debug(http: aiohttp.ClientSession, stargate: StargateAddrs) -> list[dict[str, Any]]:
    async with http.get(f"http://{stargate.http}/debug/routing") as resp:
        body = await resp.json()
    return [c for t in body["targets"] if t["model_id"] == MODEL for c in t["clusters"]]


async def _routes(http: aiohttp.ClientSession, stargate: StargateAddrs) -> dict[str, int]:
    """Routes each backend last published to ``stargate``."""
    return {b["inference_server_id"]: b["stats"]["recent_cache_affinity_routes"]
            for c in await _debug(http, stargate) for b in c["backends"]}  # fmt: skip


async def _send(
    http: aiohttp.ClientSession, stargate: StargateAddrs, key: str, request_id: str, tokens: int = 1
) -> str:
    headers = {"x-request-id": request_id, "x-model": MODEL, "x-input-tokens": "50",
               "x-output-tokens": str(tokens), "x-cache-affinity-key": key,
               "x-max-wait-ms": "5000"}  # fmt: skip
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    async with http.post(f"http://{stargate.http}/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        assert resp.status == 200, await resp.text()
        return resp.headers["x-stargate-cluster-id"]


async def test_a_replica_sends_a_key_where_the_other_replica_placed_it(
    replicas: list[StargateAddrs],
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for stargate in replicas:

            async def two_clusters(sg: StargateAddrs = stargate) -> bool:
                return len(await _debug(http, sg)) == 2

            await until("two routable clusters", two_clusters, timeout_s=READY_TIMEOUT_S, interval_s=0.05)
        placed: dict[str, tuple[str, str]] = {}
        for index in range(KEYS):
            key = f"session-{index}"
            first, other = replicas[index % 2], replicas[1 - index % 2]
            before = await _routes(http, other)
            running = asyncio.create_task(_send(http, first, key, f"{key}-first", tokens=300))  # ~3 s

            async def learnt(sg: StargateAddrs = other, known: dict[str, int] = before) -> bool:
                now = await _routes(http, sg)
                return any(count > known.get(backend, 0) for backend, count in now.items())

            try:
                await until("the other replica holds the route", learnt, timeout_s=5.0, interval_s=0.02)
                second = await _send(http, other, key, f"{key}-second")
            finally:
                where = await running
            placed[key] = (where, second)
        assert all(first == second for first, second in placed.values()), placed
