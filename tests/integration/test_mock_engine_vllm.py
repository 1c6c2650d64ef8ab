"""The mock engine's vllm batching mode over real loopback HTTP: stats, metrics and prefix cache."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import orjson
from support.waiting import until

from stargate.mock_engine import Engine, EngineConfig, TimingConfig, start_server

PROMPT = "The same long system prompt for both requests. " * 12


def chat(request_id: str) -> tuple[dict[str, object], dict[str, str]]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "stream": True}
    return body, {"x-request-id": request_id}


async def gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


async def test_vllm_mode_reports_waiting_and_reuses_the_prefix_cache() -> None:
    timing = TimingConfig(num_tokens=4, token_delay_ms=250.0, prefill_tokens_per_s=20000.0, batching="vllm")
    config = EngineConfig(
        timing=timing,
        max_concurrent_requests=1,
        kv_cache_capacity_tokens=10000,
        kv_cache_mode="prefix",
    )
    engine = Engine(config)
    runner, url = await start_server(engine, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            stats = await session.get(url + "/pylon/v1/stats/stream")
            body, headers = chat("first")
            first = await session.post(url + "/v1/chat/completions", json=body, headers=headers)
            body, headers = chat("second")
            post = session.post(url + "/v1/chat/completions", json=body, headers=headers)
            second = asyncio.create_task(post)

            async def one_waiting() -> bool:
                return await gauge(session, url, "vllm:num_requests_waiting") == 1.0

            await until("one request waiting", one_waiting)
            assert await gauge(session, url, "vllm:num_requests_running") == 1.0
            assert await gauge(session, url, "sglang:num_queue_reqs") == 1.0
            await first.read()
            response = await asyncio.wait_for(second, 5)
            assert int(response.headers["x-kv-cache-reused-input-tokens"]) > 0
            assert (await response.read()).endswith(b"data: [DONE]\n\n")
            assert int(first.headers["x-kv-cache-reused-input-tokens"]) == 0

            async def idle() -> bool:
                return await gauge(session, url, "vllm:num_requests_running") == 0.0

            await until("nothing running", idle)
            prompt_tokens = float(first.headers["x-mock-input-tokens"]) * 2
            assert await gauge(session, url, "vllm:prompt_tokens_total") == prompt_tokens
            async with session.get(url + "/kv-cache/stats") as r:
                kv = await r.json()
            assert kv["kv_cache_hit_count"] == 1 and kv["kv_cache_miss_count"] == 1
            events: list[tuple[str, int, bool | None]] = []
            while sum(1 for event in events if event[2]) < 2:
                line = await asyncio.wait_for(stats.content.readline(), 5)
                event = orjson.loads(line)
                if event["type"] == "stats":
                    events.append((event["request_id"], event["tokens_generated"], event.get("finished")))
            stats.close()
    finally:
        await runner.cleanup()
    # the second request was admitted (its start event) only once the first produced its last token
    assert events.index(("second", 0, None)) > events.index(("first", 4, None))


async def test_a_request_admitted_during_a_long_prefill_reuses_the_chunks_scheduled_so_far() -> None:
    # 32-token steps at 60 tokens/s: the shared prompt takes several 0.53 s steps, so the second
    # request is admitted while the first is still prefilling, and finds the blocks of its chunks.
    timing = TimingConfig(
        num_tokens=1,
        token_delay_ms=1.0,
        prefill_tokens_per_s=60.0,
        batching="vllm",
        max_num_batched_tokens=32,
    )
    engine = Engine(EngineConfig(timing=timing, kv_cache_capacity_tokens=10000, kv_cache_mode="prefix"))
    runner, url = await start_server(engine, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            body, headers = chat("first")
            first = asyncio.create_task(
                session.post(url + "/v1/chat/completions", json=body, headers=headers)
            )

            async def admitted() -> bool:
                return await gauge(session, url, "vllm:num_requests_running") == 1.0

            await until("the first request prefilling", admitted)
            body, headers = chat("second")
            second = await session.post(url + "/v1/chat/completions", json=body, headers=headers)
            await second.read()
            await (await first).read()
    finally:
        await runner.cleanup()
    reused = int(second.headers["x-kv-cache-reused-input-tokens"])
    total = int(second.headers["x-mock-input-tokens"])
    assert 32 <= reused < total  # at least the first chunk, not the chunks scheduled after it


async def test_a_prompt_past_the_model_length_is_a_400_and_does_not_hold_the_engine() -> None:
    """Without a prefill rate a 2^32-token claim took millions of zero-time steps, and every request
    after it waited for them."""
    timing = TimingConfig(num_tokens=2, token_delay_ms=1.0, batching="vllm")
    engine = Engine(EngineConfig(timing=timing, max_model_len=1000))
    runner, url = await start_server(engine, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            body, headers = chat("huge")
            long = await session.post(url + "/v1/chat/completions", json=body,
                                      headers=headers | {"x-input-tokens": str(2**32)})  # fmt: skip
            error = orjson.loads(await long.read())["error"]
            assert long.status == 400 and "maximum context length is 1000 tokens" in error["message"]
            body, headers = chat("at-the-limit")
            fits = await session.post(url + "/v1/chat/completions", json=body,
                                      headers=headers | {"x-input-tokens": "1000"})  # fmt: skip
            assert fits.status == 200 and (await fits.read()).endswith(b"data: [DONE]\n\n")
    finally:
        await runner.cleanup()
