"""What Pylon publishes of its load tracks its own in-flight requests, with a real mock engine and a
real Pylon process, while the engine's own report lags (paused engine) or counts extra requests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from support.pylon_fakes import MOCK_LINE, FakeStargate, pylon_args, read_line, spawn
from support.waiting import value_of

from stargate.proto import stargate_pb2
from stargate.wire.proto import CACHED_PROMPT_WORK

TOKENS = 40
HEARTBEAT_MS = 5000  # changes must reach Stargate long before a heartbeat would carry them
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def latest(stargate: FakeStargate) -> stargate_pb2.ModelStats | None:
    if not stargate.messages or "llama" not in stargate.messages[-1].models:
        return None
    return stargate.messages[-1].models["llama"].stats


async def published(
    stargate: FakeStargate,
    what: str,
    check: Callable[[stargate_pb2.ModelStats], bool],
    timeout_s: float = 3.0,
) -> stargate_pb2.ModelStats:
    def matching() -> stargate_pb2.ModelStats | None:
        stats = latest(stargate)
        return stats if stats is not None and check(stats) else None

    return await value_of(f"publication of {what}", matching, timeout_s=timeout_s,
                          details=lambda: f"last published: {latest(stargate)}")  # fmt: skip


async def stream(client: aiohttp.ClientSession, url: str, request_id: str) -> None:
    headers = {"x-request-id": request_id, "x-model": "llama", "x-input-tokens": str(TOKENS)}
    async with client.post(f"{url}/v1/chat/completions", json=BODY, headers=headers) as resp:
        await resp.read()


@contextlib.asynccontextmanager
async def engine_and_pylon(
    stargate: FakeStargate, engine_flags: list[str], pylon_flags: list[str], tasks: list[asyncio.Task[None]]
) -> AsyncIterator[tuple[str, str]]:
    """A mock engine and a Pylon in front of it registered with ``stargate``: their URLs. On exit
    the client ``tasks`` are cancelled, then both processes killed."""
    engine = await spawn(
        "stargate.mock_engine.cli",
        "--http-listen-addr", "127.0.0.1:0",
        "--model-name", "llama",
        "--max-concurrent-requests", "8",
        *engine_flags,
    )  # fmt: skip
    pylon: asyncio.subprocess.Process | None = None
    try:
        engine_url = (await read_line(engine, MOCK_LINE)).rstrip("/")
        pylon = await spawn(
            *pylon_args(
                engine_url,
                stargate.address,
                "--disable-bringup",
                "--initial-input-tps", "1000",
                "--max-engine-concurrency", "8",
                "--min-update-interval-ms", str(HEARTBEAT_MS),
                "--stats-update-coalesce-ms", "10",
                *pylon_flags,
            )
        )  # fmt: skip
        ready = await read_line(pylon, "pylon ready ")
        await stargate.wait_messages(1, timeout=20)
        yield engine_url, "http://" + dict(part.split("=", 1) for part in ready.split())["http"]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for proc in (pylon, engine):
            if proc is not None and proc.returncode is None:
                proc.kill()
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()


@pytest.mark.parametrize("source", ["prometheus", "stream"])
async def test_published_load_tracks_pylon_in_flight_while_engine_lags(
    stargate: FakeStargate, source: str
) -> None:
    source_flags = (
        ["--engine-stats-source", "prometheus", "--engine-stats-stream", "off"]
        if source == "prometheus"
        else ["--engine-stats-stream", "required"]
    )
    engine_flags = ["--num-tokens", "400", "--token-delay-ms", "25"]
    pylon_flags = ["--engine-metrics-interval-ms", "50", *source_flags]
    tasks: list[asyncio.Task[None]] = []
    async with engine_and_pylon(stargate, engine_flags, pylon_flags, tasks) as (engine_url, pylon_url):
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{engine_url}/test-control/pause") as resp:
                assert resp.status == 200
            tasks += [asyncio.create_task(stream(client, pylon_url, f"r{i}")) for i in range(3)]
            # A request Pylon does not relay: only the engine's own report can count it.
            tasks.append(asyncio.create_task(stream(client, engine_url, "foreign")))

            # The paused engine reports nothing running; Pylon publishes its three pending requests.
            stats = await published(stargate, "3 pending", lambda s: s.num_running_queries == 3)
            assert (stats.queue_size, stats.queued_input_size, stats.total_query_input_size) == (
                3,
                3 * TOKENS,
                3 * TOKENS,
            )
            assert (stats.input_processing_queries, stats.output_generation_queries) == (0, 0)
            async with client.get(f"{engine_url}/metrics") as resp:
                assert 'vllm:num_requests_running{model_name="llama"} 0.0' in await resp.text()

            async with client.post(f"{engine_url}/test-control/resume") as resp:
                assert resp.status == 200
            stats = await published(stargate, "3 decoding", lambda s: s.output_generation_queries == 3)
            assert (stats.queue_size, stats.queued_input_size, stats.total_query_input_size) == (
                0,
                0,
                3 * TOKENS,
            )
            # The engine runs 4 (the foreign one too) under vLLM's and SGLang's names: the Prometheus
            # Pylon publishes max(3 own, 4 engine) = 4, never a sum (8 before the fix, 7 with a sum).
            expected = 3
            if source == "prometheus":
                expected = 4
                stats = await published(stargate, "engine report", lambda s: s.num_running_queries != 3)
                assert stats.num_running_queries == expected
            running = [
                m.models["llama"].stats.num_running_queries for m in stargate.messages if "llama" in m.models
            ]
            assert max(running) == expected

            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await published(stargate, "all released", lambda s: s.num_running_queries == 0, timeout_s=10)
        assert len(stargate.messages) < 200  # coalesced, not one message per chunk


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_published_prompt_work_leaves_out_what_the_engine_holds_cached(
    stargate: FakeStargate, prefix_caching: bool
) -> None:
    tasks: list[asyncio.Task[None]] = []
    engine_flags = ["--num-tokens", "1"]
    pylon_flags = ["--benchmark-pin-input-tps", "--engine-prefix-caching", str(prefix_caching).lower()]
    async with engine_and_pylon(stargate, engine_flags, pylon_flags, tasks) as (engine_url, pylon_url):

        async def turn(client: aiohttp.ClientSession, request_id: str, tokens: int, key: str | None) -> None:
            headers = {"x-request-id": request_id, "x-model": "llama", "x-input-tokens": str(tokens)}
            if key is not None:
                headers["x-cache-affinity-key"] = key
            async with client.post(f"{pylon_url}/v1/chat/completions", json=BODY, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()

        async with aiohttp.ClientSession() as client:
            await turn(client, "first-turn", 1000, "conv")  # prefilled and answered: the engine holds it
            async with client.post(f"{engine_url}/test-control/pause") as resp:
                assert resp.status == 200
            tasks += [
                asyncio.create_task(turn(client, "second-turn", 1200, "conv")),
                asyncio.create_task(turn(client, "keyless", 500, None)),
            ]
            stats = await published(stargate, "2 pending", lambda s: s.queue_size == 2)
            work = 200 + 500 if prefix_caching else 1200 + 500
            assert (stats.queued_input_size, stats.total_query_input_size) == (work, 1700)
            assert dict(stats.queue_time_estimate_ms_by_priority) == {0: work}  # ms at 1000 tokens/s
            # It says so, so that a router credits no expected cache hit on top.
            assert (CACHED_PROMPT_WORK in stats.stats_capabilities) is prefix_caching
            async with client.post(f"{engine_url}/test-control/resume") as resp:
                assert resp.status == 200
            await asyncio.gather(*tasks)


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_published_input_rate_counts_the_prompt_work_the_engine_did(
    stargate: FakeStargate, prefix_caching: bool
) -> None:
    """Each turn of a conversation adds 2 000 tokens the engine prefills at 10 000 tokens/s; the
    rest it holds cached. Counted whole, the turns read 10 000 to 60 000 tokens/s."""
    tasks: list[asyncio.Task[None]] = []
    engine_flags = [
        "--num-tokens",
        "1",
        "--prefill-tokens-per-s",
        "10000",
        "--kv-cache-capacity-tokens",
        "100000",
    ]
    pylon_flags = [
        "--engine-stats-stream",
        "required",
        "--engine-prefix-caching",
        str(prefix_caching).lower(),
    ]
    async with engine_and_pylon(stargate, engine_flags, pylon_flags, tasks) as (_, pylon_url):
        async with aiohttp.ClientSession() as client:
            for turn in range(1, 7):
                headers = {
                    "x-request-id": f"turn-{turn}",
                    "x-model": "llama",
                    "x-input-tokens": str(2000 * turn),
                    "x-cache-affinity-key": "conv",
                }
                async with client.post(
                    f"{pylon_url}/v1/chat/completions", json=BODY, headers=headers
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
            sent = len(stargate.messages)
        # The last turn's sample was taken at its first token: every snapshot sent after the turn
        # ended (coalesced for 10 ms) carries it.
        stats = await published(
            stargate,
            "the last turn's end",
            lambda s: len(stargate.messages) > sent and s.num_running_queries == 0,
        )
        # The bootstrap (1 000, as five samples) and six samples of 10 000 each, or of 10 000 to 60 000.
        if prefix_caching:
            assert 3000 < stats.last_mean_input_tps <= (5 * 1000 + 6 * 10_000) / 11 * 1.05
        else:
            assert stats.last_mean_input_tps > 12_000
