"""The whole chain as real processes: 1 stargate, 2 pylons (one cluster), 2 mock engines.

Both Pylons share ``--cluster-id c1``. Pylon A heartbeats once a minute, so Stargate keeps routing
on A's idle first snapshot while A's own queue fills behind its paused engine: A answers
``429 queue_estimate_mismatch`` and Stargate retries on B. Pylon B heartbeats every 50 ms with
``--max-engine-concurrency 3``; its engine's advertised limit is moved through test control to
watch fallback → engine report → explicit withdrawal (pylon spec §6.8) in Stargate's
``/debug/routing``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import openai
import pytest
from support.waiting import value_of

from stargate.bench.fleet import (
    PylonAddrs,
    StargateAddrs,
    command,
    parse_engine_ready,
    parse_pylon_ready,
    parse_stargate_ready,
)
from stargate.bench.procs import ManagedProcess, stop_all

MODEL = "llama"
FALLBACK_LIMIT = 3
READY_TIMEOUT_S = 20.0
POLL_DEADLINE_S = 8.0
T = TypeVar("T")


@dataclass
class Chain:
    stargate: StargateAddrs
    pylons: dict[str, PylonAddrs]
    engines: dict[str, str]
    procs: list[ManagedProcess[Any]]
    http: aiohttp.ClientSession

    def tails(self) -> str:
        return "\n".join(p.log_tail(20) for p in self.procs)


def _engine(name: str, log_dir: Path) -> ManagedProcess[str]:
    argv = [*command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
            "--token-delay-ms", "1", "--num-tokens", "4"]  # fmt: skip
    return ManagedProcess(f"engine-{name}", argv, log_dir, parse_engine_ready)


def _pylon(
    name: str, engine: str, stargate: StargateAddrs, log_dir: Path, *extra: str
) -> ManagedProcess[PylonAddrs]:
    argv = [*command("pylon"), "--upstream-http-base-url", engine, "--stargate-address", stargate.grpc,
            "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--inference-server-id", f"pylon-{name}", "--cluster-id", "c1", "--model-name", MODEL,
            "--initial-input-tps", "1000",
            # A canary held by engine A's pause would mark A INACTIVE; canaries have their own tests.
            "--active-canary-interval-ms", "0", *extra]  # fmt: skip
    return ManagedProcess(f"pylon-{name}", argv, log_dir, parse_pylon_ready)


@pytest.fixture
async def chain(tmp_path: Path) -> AsyncIterator[Chain]:
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[T]) -> T:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    try:
        stargate_argv = [*command("stargate"), "--stargate-id", "sg-0", "--listen-addr", "127.0.0.1:0",
                         "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
                         "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1",
                         "--metrics-port", "0", "--disable-dns-discovery"]  # fmt: skip
        stargate, engine_a, engine_b = await asyncio.gather(
            launch(ManagedProcess("stargate", stargate_argv, tmp_path, parse_stargate_ready)),
            launch(_engine("a", tmp_path)),
            launch(_engine("b", tmp_path)),
        )
        pylon_a, pylon_b = await asyncio.gather(
            launch(_pylon("a", engine_a, stargate, tmp_path, "--min-update-interval-ms", "60000")),
            launch(_pylon("b", engine_b, stargate, tmp_path, "--min-update-interval-ms", "50",
                          "--max-engine-concurrency", str(FALLBACK_LIMIT))),
        )  # fmt: skip
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            yield Chain(stargate, {"a": pylon_a, "b": pylon_b}, {"a": engine_a, "b": engine_b}, procs, http)
    finally:
        await stop_all(procs, grace_s=3.0)


async def poll(chain: Chain, what: str, probe: Callable[[], Awaitable[T | None]]) -> T:
    """``probe()`` until it returns non-None; fails with the process logs after the deadline."""

    async def alive_then_probe() -> T | None:
        for proc in chain.procs:
            assert proc.returncode is None, f"{proc.name} exited\n{proc.log_tail()}"
        return await probe()

    return await value_of(
        what, alive_then_probe, timeout_s=POLL_DEADLINE_S, interval_s=0.05, details=chain.tails
    )


async def backend_stats(chain: Chain) -> dict[str, dict[str, Any]]:
    """``inference_server_id`` → latest published stats, from Stargate's ``/debug/routing``."""
    async with chain.http.get(f"http://{chain.stargate.http}/debug/routing") as resp:
        assert resp.status == 200
        body = await resp.json()
    return {
        backend["inference_server_id"]: backend["stats"]
        for target in body["targets"]
        if target["model_id"] == MODEL
        for cluster in target["clusters"]
        for backend in cluster["backends"]
    }


async def metric(chain: Chain, addr: str | None, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    assert addr is not None
    async with chain.http.get(f"http://{addr}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for match in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def engine_chats(chain: Chain, engine: str) -> int:
    """Gateway chat completions the engine has received (its test-control counters)."""
    async with chain.http.get(f"{chain.engines[engine]}/test-control") as resp:
        counters = (await resp.json())["counters"]
    return sum(
        c["count"]
        for c in counters
        if c["endpoint"] == "chat_completions" and c["request_class"] == "api_gateway"
    )


def gateway_headers(request_id: str, input_tokens: int = 8) -> dict[str, str]:
    return {"x-request-id": request_id, "x-model": MODEL, "x-input-tokens": str(input_tokens)}


async def chat(chain: Chain, request_id: str) -> tuple[int, dict[str, str], bytes]:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hello"}]}
    url = f"http://{chain.stargate.http}/v1/chat/completions"
    async with chain.http.post(url, json=body, headers=gateway_headers(request_id)) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def test_e2e_stargate_two_pylons_two_engines(chain: Chain) -> None:
    # b. Both backends reach Stargate's routing state with their published stats.
    async def both_backends() -> dict[str, dict[str, Any]] | None:
        stats = await backend_stats(chain)
        return stats if {"pylon-a", "pylon-b"} <= set(stats) else None

    first = await poll(chain, "both backends in /debug/routing", both_backends)
    for stats in first.values():
        assert stats["last_mean_input_tps"] == 1000.0 and stats["num_running_queries"] == 0
    # d. The CLI fallback is published from B's very first registration (engine B advertises nothing).
    assert first["pylon-b"]["max_engine_concurrency"] == FALLBACK_LIMIT
    assert first["pylon-a"]["max_engine_concurrency"] == 0

    # a. A streaming chat completion through the real OpenAI client.
    client = openai.AsyncOpenAI(base_url=f"http://{chain.stargate.http}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_headers=gateway_headers("e2e-openai"),
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    finally:
        await client.close()
    assert "".join(pieces).strip()
    for i in range(2):
        status, headers, payload = await chat(chain, f"e2e-plain-{i}")
        assert status == 200 and b"data: [DONE]" in payload
        assert headers["x-inference-server-id"] in {"pylon-a", "pylon-b"}
        assert headers["x-stargate-cluster-id"] == "c1"

    # c. Pylon A's queue fills behind its paused engine; Stargate still sees A's idle snapshot.
    async with chain.http.post(f"{chain.engines['a']}/test-control/pause") as resp:
        assert resp.status == 200
    pylon_a = chain.pylons["a"]
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "stuck"}]}

    async def direct() -> int:
        url = f"http://{pylon_a.http}/v1/chat/completions"
        async with chain.http.post(url, json=body, headers=gateway_headers("e2e-stuck", 50_000)) as resp:
            await resp.read()
            return resp.status

    chats_before = await engine_chats(chain, "a")
    stuck = asyncio.create_task(direct())
    try:

        async def reached_engine() -> bool | None:
            return await engine_chats(chain, "a") > chats_before or None

        # The engine counts a request on arrival, before the pause holds it: Pylon A is tracking it.
        await poll(chain, "the stuck request to reach engine A", reached_engine)
        retries_before = await metric(chain, chain.stargate.metrics, "stargate_proxy_retries_total",
                                      reason="queue_estimate_mismatch")  # fmt: skip
        for i in range(3):  # round robin over {a, b}: at least one of these is routed to A first
            status, headers, _ = await chat(chain, f"e2e-retry-{i}")
            assert status == 200
            assert headers["x-inference-server-id"] == "pylon-b", headers
        retries = await metric(chain, chain.stargate.metrics, "stargate_proxy_retries_total",
                               reason="queue_estimate_mismatch")  # fmt: skip
        assert retries - retries_before >= 1
        rejected = await metric(chain, pylon_a.metrics, "pylon_queue_admission_decisions_total",
                                inference_server_id="pylon-a", result="rejected")  # fmt: skip
        assert rejected >= 1
        assert await metric(chain, pylon_a.metrics, "pylon_retryable_responses_total",
                            reason="queue_estimate_mismatch", status="429") == rejected  # fmt: skip
    finally:
        async with chain.http.post(f"{chain.engines['a']}/test-control/resume") as resp:
            assert resp.status == 200
        assert await asyncio.wait_for(stuck, 10) == 200

    # d. An engine-reported limit overrides the fallback; an explicit 0 withdraws it again.
    def limit_is(expected: int) -> Callable[[], Awaitable[bool | None]]:
        async def probe() -> bool | None:
            stats = (await backend_stats(chain)).get("pylon-b")
            return (stats is not None and stats["max_engine_concurrency"] == expected) or None

        return probe

    control = f"{chain.engines['b']}/test-control/models/{MODEL}"
    for advertised, published in ((7, 7), (0, FALLBACK_LIMIT)):
        async with chain.http.put(control, json={"max_engine_concurrency": advertised}) as resp:
            assert resp.status == 200
            assert (await resp.json())["max_engine_concurrency_overrides"] == {MODEL: advertised}
        await poll(chain, f"pylon B to publish {published}", limit_is(published))
