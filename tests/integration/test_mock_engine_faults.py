"""Fault injection, metrics, request log, prefix-mode KV and continuous batching over loopback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from support.mock_engine import running
from support.waiting import until

from stargate.mock_engine import TimingConfig


def chat(stream: bool = False, content: str = "hello world") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "stream": stream}


async def put_faults(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.put(url + "/test-control/faults", json=body) as response:
        assert response.status == 200, await response.text()


async def test_fail_next_requests_with_retryable_marker() -> None:
    async with running() as (url, _, session):
        await put_faults(session, url, {"fail_next": 2, "fail_status": 429, "fail_retryable": True,
                                        "fail_retry_after_s": 2})  # fmt: skip
        statuses = []
        for _ in range(3):
            async with session.post(url + "/v1/chat/completions", json=chat()) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert r.headers["x-stargate-upstream-retryable"] == "true"
                    assert r.headers["retry-after"] == "2"
        assert statuses == [429, 429, 200]


async def test_a_full_waiting_queue_is_a_retryable_429_that_names_the_limit() -> None:
    timing = TimingConfig(num_tokens=50, token_delay_ms=20)
    async with (
        running(timing=timing, max_concurrent_requests=1, max_waiting_requests=0) as (url, _, session),
        session.post(url + "/v1/chat/completions", json=chat(True)) as first,
    ):
        await first.content.readline()  # it holds the only slot
        for path, body in (("/v1/chat/completions", chat()), ("/v1/embeddings", {"input": "hi"})):
            async with session.post(url + path, json=body) as r:
                assert r.status == 429 and r.headers["x-stargate-upstream-retryable"] == "true"
                error = (await r.json())["error"]
            assert error == {"message": "waiting queue full (--max-waiting-requests 0)", "code": 429}


async def test_invalid_fault_body_is_400() -> None:
    async with (
        running() as (url, _, session),
        session.put(url + "/test-control/faults", json={"fail_status": 99}) as r,
    ):
        assert r.status == 400 and "fail_status" in await r.text()


async def test_hang_before_first_byte() -> None:
    async with running() as (url, engine, session):
        await put_faults(session, url, {"hang_next": 1, "hang_ms": 300})
        request = asyncio.create_task(session.post(url + "/v1/chat/completions", json=chat(True)))
        await until("the request at the engine", lambda: engine.control.faults.hang_next == 0)
        assert not request.done()
        response = await asyncio.wait_for(request, 2)
        await response.read()
        async with session.post(url + "/v1/chat/completions", json=chat(True)) as r:  # only the next one
            assert r.status == 200


async def test_extra_latency_applies_until_cleared() -> None:
    async with running() as (url, _, session):
        await put_faults(session, url, {"extra_latency_ms": 60})
        start = time.monotonic()
        async with session.post(url + "/v1/chat/completions", json=chat()) as r:
            await r.read()
        assert time.monotonic() - start >= 0.059
        async with session.delete(url + "/test-control/faults") as r:
            assert (await r.json())["faults"]["extra_latency_ms"] == 0


async def test_drop_connection_after_k_chunks() -> None:
    async with running(timing=TimingConfig(num_tokens=10, token_delay_ms=1)) as (url, engine, session):
        await put_faults(session, url, {"drop_next": 1, "drop_after_chunks": 3})
        received = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(url + "/v1/chat/completions", json=chat(True)) as r:
                async for chunk in r.content.iter_any():
                    received += chunk
        assert received.count(b'"content"') == 3 and b"[DONE]" not in received
        assert engine.slots.running == 0


async def test_pause_stalls_streams_until_resume() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=4, token_delay_ms=10)) as (url, engine, session),
        session.post(url + "/test-control/pause") as r,
    ):
        assert (await r.json())["paused"] is True
        request = asyncio.create_task(session.post(url + "/v1/chat/completions", json=chat()))
        await until("the request at the engine", lambda: sum(engine.control.counters.values()) == 1)
        assert not request.done()
        await (await session.post(url + "/test-control/resume")).read()
        response = await asyncio.wait_for(request, 2)
        assert response.status == 200
        await response.read()


async def test_metrics_use_vllm_and_sglang_names() -> None:
    async with running(kv_cache_capacity_tokens=100, model="llama") as (url, _, session):
        headers = {"x-cache-affinity-key": "k", "x-input-tokens": "25"}
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as r:
            await r.read()
        async with session.get(url + "/metrics") as r:
            text = await r.text()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert samples['vllm:num_requests_running{model_name="llama"}'] == "0.0"
    assert samples['vllm:num_requests_waiting{model_name="llama"}'] == "0.0"
    assert samples['vllm:kv_cache_usage_perc{model_name="llama"}'] == "0.25"
    assert samples['vllm:gpu_cache_usage_perc{model_name="llama"}'] == "0.25"
    assert samples['sglang:token_usage{model_name="llama"}'] == "0.25"
    assert samples['sglang:max_total_num_tokens{model_name="llama"}'] == "100.0"
    assert 'sglang:num_running_reqs{model_name="llama"}' in samples
    assert 'sglang:num_queue_reqs{model_name="llama"}' in samples


async def counter(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + "{")))


@pytest.mark.parametrize("batching", ["independent", "continuous", "vllm"])
async def test_metrics_count_finished_requests_and_tokens_as_they_are_produced(batching: str) -> None:
    timing = TimingConfig(num_tokens=10, token_delay_ms=20, batching=batching)
    async with running(timing=timing) as (url, engine, session):
        async with session.post(url + "/v1/chat/completions", json=chat(True)) as r:
            received = 0
            while received < 3:
                received += (await r.content.readline()).count(b'"content"')
            assert await counter(session, url, "vllm:request_success_total") == 0
            assert await counter(session, url, "vllm:generation_tokens_total") >= 3
            await r.read()
        assert await counter(session, url, "vllm:request_success_total") == 1
        async with session.post(url + "/v1/chat/completions", json=chat(True)) as r:
            await r.content.readline()  # the client leaves after its first token
        await until("the abandoned request gone", lambda: engine.running == 0)
        async with session.post(url + "/v1/chat/completions", json=chat()) as r:
            await r.read()
        assert await counter(session, url, "vllm:request_success_total") == 2
        assert 20 < await counter(session, url, "vllm:generation_tokens_total") < 30


async def test_request_log_records_ground_truth(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    timing = TimingConfig(num_tokens=2, token_delay_ms=0, prefill_tokens_per_s=10_000)
    config = {"kv_cache_capacity_tokens": 1000, "request_log": str(log), "backend_id": "b0"}
    async with running(timing=timing, **config) as (url, engine, session):
        for rid in ("r1", "r2"):
            headers = {"x-request-id": rid, "x-cache-affinity-key": "k", "x-input-tokens": "100"}
            async with session.post(url + "/v1/chat/completions", json=chat(True), headers=headers) as r:
                await r.read()
        assert engine.log is not None
    rows = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert [row["request_id"] for row in rows] == ["r1", "r2"]
    first, second = rows
    assert first["backend_id"] == "b0" and first["status"] == 200 and first["outcome"] == "ok"
    assert (first["hit"], first["hit_tokens"], second["hit"], second["hit_tokens"]) == (False, 0, True, 100)
    assert first["input_tokens"] == 100 and first["emitted_tokens"] == 2
    assert first["prefill_ms"] >= 9.0 and second["prefill_ms"] < 5.0
    assert first["arrival"] <= first["first_token"] <= first["finish"]


async def test_arrival_log_names_a_request_before_it_finishes(tmp_path: Path) -> None:
    log = tmp_path / "arrivals.jsonl"
    async with running(arrival_log=str(log), backend_id="b0") as (url, _, session):
        async with session.post(url + "/test-control/pause") as r:
            assert r.status == 200
        held = asyncio.create_task(
            session.post(url + "/v1/chat/completions", json=chat(), headers={"x-request-id": "held"})
        )
        await until("an arrival line for the held request", lambda: log.exists() and bool(log.read_bytes()))
        assert not held.done()
        (row,) = [orjson.loads(line) for line in log.read_bytes().splitlines()]
        assert (row["request_id"], row["backend_id"]) == ("held", "b0") and row["arrival"] > 0
        async with session.post(url + "/test-control/resume") as r:
            assert r.status == 200
        async with await held as response:
            assert response.status == 200


async def test_prefix_mode_concurrent_same_prefix_then_hit() -> None:
    timing = TimingConfig(num_tokens=1, token_delay_ms=0, prefill_tokens_per_s=2000)
    prompt = "x" * 800  # 200 tokens at 4 bytes per token
    config = {"kv_cache_capacity_tokens": 10_000, "kv_cache_mode": "prefix", "kv_block_size": 16}
    async with running(timing=timing, **config) as (url, _, session):

        async def send() -> aiohttp.ClientResponse:
            response = await session.post(url + "/v1/chat/completions", json=chat(content=prompt))
            await response.read()
            return response

        first, second = await asyncio.gather(send(), send())
        assert first.headers["x-kv-cache-hit"] == second.headers["x-kv-cache-hit"] == "false"
        third = await send()
        assert third.headers["x-kv-cache-hit"] == "true"
        input_tokens = int(third.headers["x-mock-input-tokens"])
        reused = int(third.headers["x-kv-cache-reused-input-tokens"])
        assert reused % 16 == 0 and 0 < reused <= input_tokens
        assert int(third.headers["x-kv-cache-uncached-input-tokens"]) == input_tokens - reused


async def test_prefix_mode_counts_and_caches_responses_instructions() -> None:
    """A Responses conversation re-sends its ``instructions`` every turn: prompt work a router
    counts and an engine caches, like a chat's system prompt."""
    timing = TimingConfig(num_tokens=1, token_delay_ms=0, prefill_tokens_per_s=100_000)
    config = {"kv_cache_capacity_tokens": 10_000, "kv_cache_mode": "prefix", "kv_block_size": 16}
    instructions = "Answer in French. " * 50  # 900 bytes
    async with running(timing=timing, **config) as (url, _, session):

        async def turn(text: str) -> aiohttp.ClientResponse:
            body = {"model": "m", "instructions": instructions, "input": text, "stream": True}
            response = await session.post(url + "/v1/responses", json=body)
            await response.read()
            return response

        first = await turn("hello")
        assert int(first.headers["x-mock-input-tokens"]) > len(instructions) // 4
        second = await turn("bonjour")
        assert int(second.headers["x-kv-cache-reused-input-tokens"]) >= len(instructions) // 4 - 16


async def test_continuous_batching_shares_prefill_throughput() -> None:
    timing = TimingConfig(num_tokens=1, token_delay_ms=0, prefill_tokens_per_s=1000, batching="continuous")
    async with running(timing=timing) as (url, _, session):

        async def send() -> None:
            headers = {"x-input-tokens": "100"}
            async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as r:
                await r.read()

        start = time.monotonic()
        await send()
        alone = time.monotonic() - start
        start = time.monotonic()
        await asyncio.gather(send(), send(), send())
        together = time.monotonic() - start
    assert alone >= 0.095
    assert together >= 0.28  # three prefills share 1000 tok/s: 300 tokens take 0.3 s


async def test_an_embeddings_request_takes_the_faults_and_logs_of_any_other(tmp_path: Path) -> None:
    """An armed hang or drop was used up by an embeddings request without being applied, and the
    request and arrival logs left embeddings out."""
    embed = {"model": "mock-model", "input": "hello"}
    config = {
        "request_log": str(tmp_path / "requests.jsonl"),
        "arrival_log": str(tmp_path / "arrivals.jsonl"),
    }
    async with running(**config) as (url, engine, session):
        await put_faults(session, url, {"hang_next": 1, "hang_ms": 300})
        start = time.monotonic()
        async with session.post(url + "/v1/embeddings", json=embed, headers={"x-request-id": "e1"}) as r:
            assert r.status == 200
        assert time.monotonic() - start >= 0.29
        await put_faults(session, url, {"drop_next": 1})
        with pytest.raises(aiohttp.ServerDisconnectedError):
            async with session.post(url + "/v1/embeddings", json=embed, headers={"x-request-id": "e2"}) as r:
                await r.read()
        assert engine.slots.running == 0
    rows = [orjson.loads(line) for line in (tmp_path / "requests.jsonl").read_bytes().splitlines()]
    assert [(row["request_id"], row["endpoint"], row["outcome"]) for row in rows] == [
        ("e1", "embeddings", "ok"),
        ("e2", "embeddings", "dropped"),
    ]
    arrivals = [orjson.loads(line) for line in (tmp_path / "arrivals.jsonl").read_bytes().splitlines()]
    assert [row["request_id"] for row in arrivals] == ["e1", "e2"]


async def test_an_embeddings_request_waiting_for_a_slot_logs_its_wait(tmp_path: Path) -> None:
    embed = {"model": "mock-model", "input": "hello"}
    log = tmp_path / "requests.jsonl"
    async with running(request_log=str(log), max_concurrent_requests=1) as (url, engine, session):
        await put_faults(session, url, {"hang_next": 1, "hang_ms": 300})

        async def post(request_id: str) -> int:
            async with session.post(
                url + "/v1/embeddings", json=embed, headers={"x-request-id": request_id}
            ) as r:
                return r.status

        holder = asyncio.create_task(post("holder"))
        await until("the slot held", lambda: engine.slots.running == 1)
        assert await asyncio.gather(holder, post("waiter")) == [200, 200]
    rows = {row["request_id"]: row for row in map(orjson.loads, log.read_bytes().splitlines())}
    assert rows["holder"]["queue_wait_ms"] < 250 <= rows["waiter"]["queue_wait_ms"]
