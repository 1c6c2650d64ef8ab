"""Pylon and the mock engine as real processes; the Stargate side is an in-process gRPC fake."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
from support.pylon_fakes import MOCK_LINE, FakeStargate, pylon_args, read_line, spawn
from support.waiting import until

from stargate.pylon.models import ModelStatus


async def test_pylon_against_mock_engine_process(stargate: FakeStargate) -> None:
    engine = await spawn(
        "stargate.mock_engine.cli",
        "--http-listen-addr",
        "127.0.0.1:0",
        "--model-name",
        "llama",
        "--token-delay-ms",
        "1",
        "--num-tokens",
        "4",
        "--max-concurrent-requests",
        "8",
    )
    pylon: asyncio.subprocess.Process | None = None
    try:
        engine_url = (await read_line(engine, MOCK_LINE)).rstrip("/")
        pylon = await spawn(
            "stargate.pylon.cli",
            "--upstream-http-base-url",
            engine_url,
            "--stargate-address",
            stargate.address,
            "--http-listen-addr",
            "127.0.0.1:0",
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--min-update-interval-ms",
            "50",
            "--initial-input-tps",
            "1000",
            "--kv-cache-stats-path",
            "/kv-cache/stats",
        )
        ready = await read_line(pylon, "pylon ready ")
        http = dict(part.split("=", 1) for part in ready.split())["http"]
        await stargate.wait_messages(1, timeout=20)
        assert "llama" in stargate.messages[-1].models
        assert stargate.messages[-1].inference_server_url == f"http://{http}"
        headers = {
            "x-request-id": "it-1",
            "x-model": "llama",
            "x-input-tokens": "5",
            "x-stargate-expected-queue-ms": "0",
        }
        body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with aiohttp.ClientSession() as client:
            async with client.post(f"http://{http}/v1/chat/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                payload = await resp.read()
            async with client.get(f"http://{http}/health") as resp:
                assert resp.status == 200
        assert payload.count(b"data:") >= 2
        n = len(stargate.messages)
        await stargate.wait_messages(n + 2, timeout=20)
        stats = stargate.messages[-1].models["llama"].stats
        assert stats.last_mean_input_tps > 0 and stats.queue_size == 0

        def engine_limit_and_kv() -> bool:  # limit pings and KV polls repeat every 1 s
            stats = stargate.messages[-1].models["llama"].stats
            return stats.max_engine_concurrency == 8 and "kv_cache_stats" in stats.stats_sources

        await until("the engine's limit and KV stats published", engine_limit_and_kv)
        stats = stargate.messages[-1].models["llama"].stats
        assert stats.max_engine_concurrency == 8
        assert list(stats.stats_sources) == ["engine_stats_stream", "kv_cache_stats"]
        pylon.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(pylon.wait(), 20) == 0
    finally:
        for proc in (pylon, engine):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_b39_canary_failure_advertises_inactive_until_recovery(stargate: FakeStargate) -> None:
    """§5.3 with real processes: the mock's chat-failure switch fails canaries, then lets them pass."""
    engine = await spawn(
        "stargate.mock_engine.cli", "--http-listen-addr", "127.0.0.1:0", "--model-name", "llama"
    )
    pylon: asyncio.subprocess.Process | None = None
    try:
        engine_url = (await read_line(engine, MOCK_LINE)).rstrip("/")
        pylon = await spawn(
            *pylon_args(
                engine_url,
                stargate.address,
                "--min-update-interval-ms", "20",
                "--active-canary-interval-ms", "50",
            )
        )  # fmt: skip
        await read_line(pylon, "pylon ready ")

        async def advertised(status: int) -> None:
            await until(
                f"status {status} advertised",
                lambda: bool(stargate.messages) and stargate.messages[-1].models["llama"].status == status,
            )

        async def control(body: dict[str, bool]) -> int:
            async with aiohttp.ClientSession() as client:
                async with client.put(f"{engine_url}/test-control/models/llama", json=body) as resp:
                    assert resp.status == 200
                async with client.get(f"{engine_url}/test-control") as resp:
                    counters = (await resp.json())["counters"]
            return sum(c["count"] for c in counters if c["request_class"] == "pylon_generated")

        await advertised(ModelStatus.ACTIVE)

        async def two_canaries() -> bool:
            return await control({}) >= 2

        await until("periodic canaries at the engine", two_canaries)
        await control({"chat_failure": True})
        await advertised(ModelStatus.INACTIVE)
        await control({"chat_failure": False})
        await advertised(ModelStatus.ACTIVE)  # health probe, then a passing canary (retried each 1 s)
    finally:
        for proc in (pylon, engine):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_signal_while_waiting_for_the_engine_stops_pylon_at_once(stargate: FakeStargate) -> None:
    """The start waits up to ``--upstream-health-wait-ms`` for a healthy engine; a supervisor's
    SIGTERM meanwhile ends it cleanly instead of after that wait."""
    probed = asyncio.Event()

    async def unhealthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        probed.set()
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(unhealthy, "127.0.0.1", 0)
    engine_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pylon = await spawn(*pylon_args(engine_url, stargate.address, "--upstream-health-wait-ms", "60000"))
    try:
        await asyncio.wait_for(probed.wait(), 20)
        pylon.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(pylon.wait(), 10) == 0
    finally:
        if pylon.returncode is None:
            pylon.kill()
            await pylon.wait()
        server.close()


async def test_a_seed_that_is_down_does_not_keep_pylon_from_the_others(stargate: FakeStargate) -> None:
    """Several ``--stargate-address`` seeds: with one of them down, Pylon registers with the rest
    (after the initial discovery wait) instead of with no Stargate until that one returns."""
    engine = await spawn(
        "stargate.mock_engine.cli", "--http-listen-addr", "127.0.0.1:0", "--model-name", "llama"
    )
    pylon: asyncio.subprocess.Process | None = None
    try:
        engine_url = (await read_line(engine, MOCK_LINE)).rstrip("/")
        pylon = await spawn(*pylon_args(engine_url, stargate.address, "--stargate-address", "127.0.0.1:9"))
        await read_line(pylon, "pylon ready ")
        await until("a registration with the seed that is up", lambda: bool(stargate.messages))
    finally:
        for proc in (pylon, engine):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
