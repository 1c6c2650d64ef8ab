"""Stargate measures a cluster's prefill rate from the requests it proxies (lb-config
``prefill_rate: measured`` ranks with it), whatever Pylon publishes.

Real processes: one Stargate, a Pylon whose published input throughput is pinned at 100 tokens/s,
and a mock engine that prefills 2000 tokens/s. After three 1000-token prompts (about 1.5 s of
prefill) ``/debug/routing`` shows a measured rate of the engine's order while the published one
stays at the pin. The bounds are loose: a loaded machine adds latency, which reads as a lower rate.
"""

from __future__ import annotations

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


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[StargateAddrs]:
    config = json.loads(RECOMMENDED.read_text())
    (settings,) = config["models"].values()
    config["models"] = {MODEL: {**settings, "prefill_rate": "measured"}}
    lb_config = tmp_path / "lb-config.json"
    lb_config.write_text(json.dumps(config))
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[Any]) -> Any:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    try:
        stargate = await launch(ManagedProcess("stargate", [
            *command("stargate"), "--stargate-id", "sg-0", "--listen-addr", "127.0.0.1:0",
            "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
            "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--disable-dns-discovery", "--lb-config-path", str(lb_config),
        ], tmp_path, parse_stargate_ready))  # fmt: skip
        engine = await launch(ManagedProcess("engine", [
            *command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
            "--max-concurrent-requests", "8", "--token-delay-ms", "5", "--num-tokens", "1",
            "--batching", "continuous", "--prefill-tokens-per-s", "2000",
        ], tmp_path, parse_engine_ready))  # fmt: skip
        await launch(ManagedProcess("pylon", [
            *command("pylon"), "--upstream-http-base-url", engine, "--stargate-address", stargate.grpc,
            "--inference-server-id", "pylon-a", "--http-listen-addr", "127.0.0.1:0",
            "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--model-name", MODEL,
            "--initial-input-tps", "100", "--benchmark-pin-input-tps", "--max-engine-concurrency", "8",
        ], tmp_path, parse_pylon_ready))  # fmt: skip
        yield stargate
    finally:
        await stop_all(procs, grace_s=3.0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        yield session


async def _cluster(http: aiohttp.ClientSession, stargate: StargateAddrs) -> dict[str, Any] | None:
    async with http.get(f"http://{stargate.http}/debug/routing") as resp:
        body = await resp.json()
    clusters = [c for t in body["targets"] if t["model_id"] == MODEL for c in t["clusters"]]
    return clusters[0] if clusters else None


async def test_the_router_measures_the_engines_prefill_rate_not_the_pinned_one(
    fleet: StargateAddrs, http: aiohttp.ClientSession
) -> None:
    async def routable() -> bool:
        return await _cluster(http, fleet) is not None

    await until("a routable backend", routable, timeout_s=READY_TIMEOUT_S)
    assert (await _cluster(http, fleet) or {})["measured_input_tps"] == 0.0
    for turn in range(3):
        headers = {"x-request-id": f"turn-{turn}", "x-model": MODEL, "x-input-tokens": "1000",
                   "x-output-tokens": "1"}  # fmt: skip
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        async with http.post(f"http://{fleet.http}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    cluster = await _cluster(http, fleet)
    assert cluster is not None
    assert cluster["stats"]["last_mean_input_tps"] == 100.0
    assert 400.0 < cluster["measured_input_tps"] <= 2500.0, cluster
