"""The README quickstart fleet at 87.5 % of its slots answers every request (issue: no 503 while
slots are free).

Real processes: one Stargate, two mock engines with 8 slots each, one Pylon on the engine's NDJSON
stats stream and one on its Prometheus ``/metrics`` (told the limit, as for a stock vLLM). 120
streaming requests at concurrency 14 without ``x-max-wait-ms``: with the original's reservation
lifetime and Pylon stats that lag, both clusters read full while two slots were free and
wait-and-widen answered 503 at once.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
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
SLOTS = 8
REQUESTS = 120
CONCURRENCY = 14  # 87.5 % of 2 x 8 slots
READY_TIMEOUT_S = 20.0
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "lb-config"


async def _fleet(
    tmp_path: Path, lb_config: Path, *router_flags: str, cached: bool = False
) -> tuple[StargateAddrs, list[ManagedProcess[Any]]]:
    """With ``cached`` the engines keep a KV cache per affinity key and the Pylons count a cached
    prompt as no work, as docs/pylon.md recommends for engines with prefix caching."""
    engine_cache = ["--kv-cache-mode", "affinity", "--kv-cache-capacity-tokens", "100000"] if cached else []
    pylon_cache = ["--engine-prefix-caching", "true"] if cached else []
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[Any]) -> Any:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    def engine(name: str) -> ManagedProcess[str]:
        argv = [*command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
                "--max-concurrent-requests", str(SLOTS),
                "--token-delay-ms", "20", "--num-tokens", "10",
                *engine_cache]  # fmt: skip
        return ManagedProcess(f"engine-{name}", argv, tmp_path, parse_engine_ready)

    stargate_argv = [*command("stargate"), "--stargate-id", "sg-0", "--listen-addr", "127.0.0.1:0",
                     "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
                     "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1",
                     "--metrics-port", "0", "--disable-dns-discovery",
                     "--lb-config-path", str(lb_config), *router_flags]  # fmt: skip
    try:
        stargate, engine_a, engine_b = await asyncio.gather(
            launch(ManagedProcess("stargate", stargate_argv, tmp_path, parse_stargate_ready)),
            launch(engine("a")),
            launch(engine("b")),
        )
        common = ["--stargate-address", stargate.grpc, "--http-listen-addr", "127.0.0.1:0",
                  "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--model-name", MODEL,
                  "--initial-input-tps", "5000", *pylon_cache]  # fmt: skip
        await asyncio.gather(
            launch(ManagedProcess("pylon-0", [*command("pylon"), "--upstream-http-base-url", engine_a,
                                              "--inference-server-id", "pylon-0", *common],
                                  tmp_path, parse_pylon_ready)),
            launch(ManagedProcess("pylon-1", [*command("pylon"), "--upstream-http-base-url", engine_b,
                                              "--inference-server-id", "pylon-1", *common,
                                              "--engine-stats-source", "prometheus",
                                              "--engine-stats-stream", "off",
                                              "--max-engine-concurrency", str(SLOTS)],
                                  tmp_path, parse_pylon_ready)),
        )  # fmt: skip
    except BaseException:
        await stop_all(procs, grace_s=3.0)
        raise
    return stargate, procs


# The seed's example alone (the spec's immediate 503 when nothing is selectable), and the README
# quickstart's router exactly: the recommended config with a default routing wait.
@pytest.fixture(params=[("seed-waw.json",), ("recommended.json", "--default-max-wait-ms", "10000")])
async def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StargateAddrs]:
    config, *flags = request.param
    stargate, procs = await _fleet(tmp_path, EXAMPLES / config, *flags)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await _wait_routable(http, stargate)
        yield stargate
    finally:
        await stop_all(procs, grace_s=3.0)


async def _wait_routable(http: aiohttp.ClientSession, stargate: StargateAddrs) -> None:
    """Both backends registered and routable (two clusters in ``/debug/routing``)."""

    async def two_clusters() -> bool:
        async with http.get(f"http://{stargate.http}/debug/routing") as resp:
            body = await resp.json()
        return len([c for t in body["targets"] if t["model_id"] == MODEL for c in t["clusters"]]) == 2

    await until("two routable clusters", two_clusters, timeout_s=READY_TIMEOUT_S, interval_s=0.05)


async def _send_all(
    http: aiohttp.ClientSession, stargate: StargateAddrs, key: Callable[[int], str]
) -> tuple[Counter[int], Counter[str]]:
    """``REQUESTS`` streaming requests, ``CONCURRENCY`` at a time, request ``i`` with key ``key(i)``:
    the statuses and the backends that answered."""
    statuses: Counter[int] = Counter()
    backends: Counter[str] = Counter()
    queue = iter(range(REQUESTS))

    async def client() -> None:
        for i in queue:
            headers = {"x-request-id": f"r{i}", "x-model": MODEL, "x-input-tokens": "50",
                       "x-cache-affinity-key": key(i)}  # fmt: skip
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
            url = f"http://{stargate.http}/v1/chat/completions"
            async with http.post(url, json=body, headers=headers) as resp:
                await resp.read()
                statuses[resp.status] += 1
                backends[resp.headers.get("x-inference-server-id", "")] += 1

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return statuses, backends


async def test_quickstart_fleet_at_seven_eighths_of_its_slots_answers_every_request(
    fleet: StargateAddrs,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        statuses, backends = await _send_all(http, fleet, lambda i: f"session-{i % 10}")
    assert statuses == Counter({200: REQUESTS}), (statuses, backends)


@pytest.mark.parametrize("spill", [True, False])
async def test_one_key_past_a_backends_slots_spills_to_the_other(tmp_path: Path, spill: bool) -> None:
    """Every request with one key, 14 at once against 8 slots per backend, its prompt cached after
    the first: the recommended config (``cache_affinity_spill``) serves them from both backends;
    without it they all queue on one (Pylon expects no prompt work and admits them all)."""
    config = orjson.loads((EXAMPLES / "recommended.json").read_bytes())
    config["models"] = {MODEL: {**next(iter(config["models"].values())), "cache_affinity_spill": spill}}
    path = tmp_path / "lb-config.json"
    path.write_bytes(orjson.dumps(config))
    stargate, procs = await _fleet(tmp_path, path, "--default-max-wait-ms", "10000", cached=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await _wait_routable(http, stargate)
            statuses, backends = await _send_all(http, stargate, lambda _: "one-account")
    finally:
        await stop_all(procs, grace_s=3.0)
    assert statuses == Counter({200: REQUESTS}), (statuses, backends)
    if spill:  # at most one request of the key waits at a full backend: 5 of 14 are always on the other
        assert min(backends["pylon-0"], backends["pylon-1"]) >= REQUESTS // 8, backends
    else:
        assert sorted(backends.values()) == [REQUESTS], backends
