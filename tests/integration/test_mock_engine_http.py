"""The mock engine over real loopback HTTP (in-process server on an ephemeral port)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from support.mock_engine import running
from support.waiting import until

from stargate.mock_engine import TimingConfig


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hello world"}], "stream": stream, **extra}


async def sse(response: aiohttp.ClientResponse) -> list[bytes]:
    body = await response.read()
    return [frame for frame in body.split(b"\n\n") if frame]


class StatsReader:
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self, skip_pings: bool = True) -> dict[str, Any]:
        while True:
            line = await asyncio.wait_for(self.response.content.readline(), 5)
            event: dict[str, Any] = orjson.loads(line)
            if not (skip_pings and event["type"] == "ping"):
                return event


@contextlib.asynccontextmanager
async def stats_stream(session: aiohttp.ClientSession, url: str) -> AsyncIterator[StatsReader]:
    async with session.get(url + "/pylon/v1/stats/stream") as response:
        reader = StatsReader(response)
        first = await reader.next(skip_pings=False)
        assert first["type"] == "ping"
        yield reader


async def test_s9_3_models_at_startup_counts_discovery() -> None:
    async with running() as (url, _, session), session.get(url + "/v1/models") as response:
        assert await response.json() == {
            "object": "list", "data": [{"id": "dummy-model", "object": "model", "owned_by": "mock"}],
        }  # fmt: skip
        async with session.get(url + "/test-control") as response:
            assert (await response.json())["model_discovery_requests"] == 1


async def test_s9_4_empty_discovery_list() -> None:
    async with (
        running() as (url, _, session),
        session.put(url + "/test-control/discovery-models", json={"models": []}) as response,
    ):
        assert (await response.json())["discovered_models"] == []
        async with session.get(url + "/v1/models") as response:
            assert (await response.json())["data"] == []


async def test_s9_5_blank_discovery_model_is_400_plain_text() -> None:
    async with (
        running() as (url, _, session),
        session.put(url + "/test-control/discovery-models", json={"models": ["a", " "]}) as r,
    ):
        assert r.status == 400 and await r.text() == "model IDs must be non-empty"


async def test_s9_6_ttft_delays_first_data_frame() -> None:
    async with (
        running(timing=TimingConfig(ttft_ms=120, token_delay_ms=0)) as (url, _, session),
        session.post(url + "/v1/chat/completions", json=chat(True)) as response,
    ):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(response.content.readline(), 0.05)
        line = await asyncio.wait_for(response.content.readline(), 1.0)
        assert line.startswith(b"data: ") and time.monotonic() - start < 1.0


async def test_s9_7_stream_of_two_tokens_without_usage() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=2, token_delay_ms=0)) as (url, _, session),
        session.post(url + "/v1/chat/completions", json=chat(True, max_tokens=2)) as response,
    ):
        assert response.headers["content-type"] == "text/event-stream"
        frames = await sse(response)
    assert frames[-1] == b"data: [DONE]"
    deltas = [orjson.loads(f.removeprefix(b"data: "))["choices"][0]["delta"] for f in frames[:-1]]
    assert deltas == [{"role": "assistant"}, {"content": "Hello"}, {"content": ","}, {}]
    assert not any(b"usage" in frame for frame in frames)


async def test_include_usage_final_chunk_over_http() -> None:
    async with running(timing=TimingConfig(num_tokens=3, token_delay_ms=0)) as (url, _, session):
        body = chat(True, stream_options={"include_usage": True})
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"x-input-tokens": "5"}
        ) as r:
            frames = await sse(r)
    usage = orjson.loads(frames[-2].removeprefix(b"data: "))
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


@pytest.mark.parametrize("connection", ["", "Connection: keep-alive\r\n"])
async def test_an_http_1_0_stream_is_bare_events_ended_by_the_connection(connection: str) -> None:
    """HTTP/1.0 has no chunked framing: size lines in the body corrupted the client's events."""
    async with running(timing=TimingConfig(num_tokens=3, token_delay_ms=0)) as (url, _, _session):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        body = orjson.dumps({"model": "m", **chat(True, max_tokens=3)})
        head = (
            "POST /v1/chat/completions HTTP/1.0\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{connection}\r\n"
        )
        writer.write(head.encode() + body)
        answer = await asyncio.wait_for(reader.read(), 5)  # the body ends with the connection
        writer.close()
        await writer.wait_closed()
    status, _, payload = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.0 200") and b"transfer-encoding" not in status.lower()
    frames = [frame for frame in payload.split(b"\n\n") if frame]
    assert len(frames) == 6 and all(frame.startswith(b"data: ") for frame in frames)
    assert frames[-1] == b"data: [DONE]"


async def test_s9_9_and_s9_49_non_streaming_json_after_full_duration() -> None:
    timing = TimingConfig(token_delay_ms=20, num_tokens=3)
    async with running(timing=timing) as (url, _, session):
        start = time.monotonic()
        async with session.post(
            url + "/v1/chat/completions", json=chat(), headers={"x-input-tokens": "11"}
        ) as r:
            body = await r.json()
            assert r.content_type == "application/json"
        assert time.monotonic() - start >= 0.039
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    assert body["choices"][0]["message"]["content"] == "Hello, how"


async def test_s9_12_a_limit_of_zero_tokens_generates_one() -> None:
    requests = (
        ("/v1/chat/completions", chat(max_tokens=0)),
        ("/v1/chat/completions", chat(max_completion_tokens=0)),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
        ("/v1/responses", {"input": "x", "max_output_tokens": 0}),
    )
    async with running(timing=TimingConfig(token_delay_ms=0, num_tokens=8)) as (url, _, session):
        for path, body in requests:
            async with session.post(url + path, json=body) as r:
                await r.read()
                assert r.status == 200 and r.headers["x-mock-output-tokens"] == "1", path


async def test_s9_16_responses_stream_false_rejected_in_parity_mode() -> None:
    async with (
        running(responses_stream_only=True) as (url, _, session),
        session.post(url + "/v1/responses", json={"input": "x", "stream": False}) as response,
    ):
        assert response.status == 400 and "stream=true" in await response.text()
        async with session.get(url + "/test-control") as response:
            assert (await response.json())["counters"] == []


async def test_responses_non_streaming_json_by_default() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=2, token_delay_ms=0)) as (url, _, session),
        session.post(url + "/v1/responses", json={"input": "hello"}) as response,
    ):
        body = await response.json()
    assert body["status"] == "completed"
    assert body["usage"] == {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}


async def test_s9_18_and_s9_19_responses_stream_events_and_kv_headers() -> None:
    async with running(kv_cache_capacity_tokens=1000) as (url, _, session):
        headers = {"x-output-tokens": "2", "x-input-tokens": "7", "x-cache-affinity-key": "new"}
        async with session.post(url + "/v1/responses", json={"stream": True}, headers=headers) as response:
            assert response.headers["x-kv-cache-hit"] == "false"
            assert response.headers["x-kv-cache-reused-input-tokens"] == "0"
            assert response.headers["x-kv-cache-uncached-input-tokens"] == "7"
            frames = await sse(response)
    names = [frame.split(b"\n", 1)[0] for frame in frames]
    # The spec's created, deltas and completed, with the item and part events the OpenAI SDK needs.
    assert names == [
        b"event: response.created", b"event: response.in_progress", b"event: response.output_item.added",
        b"event: response.content_part.added", *[b"event: response.output_text.delta"] * 2,
        b"event: response.output_text.done", b"event: response.content_part.done",
        b"event: response.output_item.done", b"event: response.completed",
    ]  # fmt: skip
    completed = orjson.loads(frames[-1].split(b"data: ", 1)[1])
    assert completed["response"]["usage"] == {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
    assert b"[DONE]" not in b"".join(frames)


async def test_s9_23_embeddings_json() -> None:
    async with running() as (url, _, session):
        body = {"model": "request-model", "input": ["a", "b"]}
        async with session.post(url + "/v1/embeddings", json=body, headers={"x-input-tokens": "9"}) as r:
            result = await r.json()
    assert result["object"] == "list" and result["model"] == "request-model"
    assert result["data"][1]["index"] == 1
    assert result["usage"] == {"prompt_tokens": 9, "total_tokens": 9}


async def test_s9_32_cache_empty_during_prefill_filled_after() -> None:
    timing = TimingConfig(prefill_tokens_per_s=1000.0, token_delay_ms=0)
    async with (
        running(timing=timing, kv_cache_capacity_tokens=10_000) as (url, _, session),
        stats_stream(session, url) as stats,
    ):
        headers = {"x-cache-affinity-key": "k", "x-input-tokens": "200", "x-request-id": "r-32"}
        request = asyncio.create_task(
            session.post(url + "/v1/chat/completions", json=chat(True), headers=headers)
        )
        assert (await stats.next())["tokens_processed"] == 0
        async with session.get(url + "/kv-cache/stats") as response:
            assert (await response.json())["kv_cache_entries"] == 0
        response = await request
        await response.read()
        async with session.get(url + "/kv-cache/stats") as response:
            assert (await response.json())["kv_cache_used_tokens"] == 200


async def test_s9_37_stats_stream_pings_immediately_then_every_second() -> None:
    async with running() as (url, _, session), session.get(url + "/pylon/v1/stats/stream") as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        start = time.monotonic()
        assert await asyncio.wait_for(response.content.readline(), 0.5) == b'{"type":"ping","v":1}\n'
        assert await asyncio.wait_for(response.content.readline(), 1.5) == b'{"type":"ping","v":1}\n'
        assert 0.8 <= time.monotonic() - start <= 1.5


async def test_ping_advertises_max_engine_concurrency() -> None:
    async with (
        running(max_concurrent_requests=25, model="llama") as (url, _, session),
        session.get(url + "/pylon/v1/stats/stream") as response,
    ):
        line = await asyncio.wait_for(response.content.readline(), 0.5)
    assert orjson.loads(line) == {"type": "ping", "v": 1, "model": "llama", "max_engine_concurrency": 25}


async def test_s9_38_and_s9_40_stream_stats_sequence() -> None:
    async with running(timing=TimingConfig(num_tokens=3, token_delay_ms=0), kv_cache_capacity_tokens=100) as (
        url, _, session,
    ):  # fmt: skip
        headers = {"x-request-id": "req-40", "x-input-tokens": "11", "x-cache-affinity-key": "k"}
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as r:
            await r.read()  # warms the cache: the streamed request below is a hit
        async with stats_stream(session, url) as stats:
            async with session.post(url + "/v1/chat/completions", json=chat(True), headers=headers) as r:
                assert r.headers["x-kv-cache-hit"] == "true"
                await r.read()
            events = [await stats.next() for _ in range(6)]
    assert {e["request_id"] for e in events} == {"req-40"}
    counters = [(e["tokens_processed"], e.get("tokens_generated"), e.get("finished", False)) for e in events]
    assert counters == [
        (0, 0, False),
        (11, 0, False),
        (11, 1, False),
        (11, 2, False),
        (11, 3, False),
        (11, 3, True),
    ]


async def test_s9_39_non_streaming_and_embeddings_events() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=2, token_delay_ms=0)) as (url, _, session),
        stats_stream(session, url) as stats,
    ):
        headers = {"x-request-id": "ns", "x-input-tokens": "4"}
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as r:
            await r.read()
        assert await stats.next() == {
            "type": "stats", "v": 1, "request_id": "ns", "model": "dummy-model",
            "tokens_processed": 4, "tokens_generated": 2, "finished": True,
        }  # fmt: skip
        headers = {"x-request-id": "emb"}
        async with session.post(url + "/v1/embeddings", json={"input": "abcd"}, headers=headers) as r:
            await r.read()
        event = await stats.next()
    assert event == {
        "type": "stats", "v": 1, "request_id": "emb", "model": "dummy-model", "tokens_processed": 4,
        "finished": True,
    }  # fmt: skip


async def test_s9_41_second_request_waits_for_slot() -> None:
    timing = TimingConfig(num_tokens=5, token_delay_ms=30)
    async with running(timing=timing, max_concurrent_requests=1) as (url, engine, session):
        first = await session.post(url + "/v1/chat/completions", json=chat(True))
        second = asyncio.create_task(session.post(url + "/v1/chat/completions", json=chat(True)))
        await until("the second request waiting for the slot", lambda: engine.slots.waiting == 1)
        assert not second.done()
        await first.read()
        response = await asyncio.wait_for(second, 2)
        frames = await sse(response)
        assert frames[-1] == b"data: [DONE]" and engine.slots.running == 0


async def test_s9_42_health_delay() -> None:
    async with running(health_delay_ms=50) as (url, _, session):
        start = time.monotonic()
        async with session.get(url + "/health") as response:
            assert await response.text() == "ok"
        assert time.monotonic() - start >= 0.049
        async with session.get(url + "/v1/health/ready") as response:
            assert response.status == 200


async def test_s9_43_and_s9_44_chat_failure_switch() -> None:
    async with (
        running() as (url, _, session),
        session.put(url + "/test-control/models/model-b", json={"chat_failure": True}) as r,
    ):
        snapshot = await r.json()
        assert snapshot["models"]["model-b"] == {"chat_failure": True, "bringup_blocked": False}
        async with session.post(url + "/v1/chat/completions", json=chat(model="model-b")) as r:
            assert r.status == 503 and "model-b" in (await r.json())["error"]["message"]
            assert "x-kv-cache-hit" not in r.headers
        async with session.post(url + "/v1/chat/completions", json=chat(model="model-a")) as r:
            assert r.status == 200
        async with session.post(url + "/v1/responses", json={"model": "model-b", "stream": True}) as r:
            assert r.status == 200
        async with session.post(url + "/v1/embeddings", json={"model": "model-b", "input": "x"}) as r:
            assert r.status == 200


async def test_s9_45_bringup_hold_over_http() -> None:
    async with running() as (url, engine, session):
        await (await session.put(url + "/test-control/models/m", json={"bringup_blocked": True})).read()
        body = chat(model="m")
        held = asyncio.create_task(
            session.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": "canary-1"})
        )
        canary = ("chat_completions", "m", "pylon_generated")
        await until("the canary at the engine", lambda: engine.control.counters.get(canary) == 1)
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"x-request-id": "user-1"}
        ) as r:
            assert r.status == 200
        assert not held.done()  # the user request was answered while the canary is held
        await (await session.put(url + "/test-control/models/m", json={"bringup_blocked": False})).read()
        response = await asyncio.wait_for(held, 2)
        assert response.status == 200
        await response.read()


async def test_s9_46_and_s9_47_counters_and_unlisted_model() -> None:
    async with running() as (url, _, session):
        for rid in ("calibration-x", "canary-y", "user-z"):
            async with session.post(
                url + "/v1/chat/completions", json=chat(model="M"), headers={"x-request-id": rid}
            ) as r:
                assert (await r.json())["model"] == "M"
        async with session.get(url + "/test-control") as r:
            counters = (await r.json())["counters"]
    assert counters == [
        {"endpoint": "chat_completions", "model": "M", "request_class": "pylon_generated", "count": 2},
        {"endpoint": "chat_completions", "model": "M", "request_class": "api_gateway", "count": 1},
    ]


async def test_s9_48_client_disconnect_releases_slot_without_finish_event() -> None:
    timing = TimingConfig(num_tokens=100, token_delay_ms=20)
    async with (
        running(timing=timing, max_concurrent_requests=1) as (url, engine, session),
        stats_stream(session, url) as stats,
    ):
        response = await session.post(
            url + "/v1/chat/completions", json=chat(True), headers={"x-request-id": "gone"}
        )
        await response.content.readline()
        response.close()
        await until("the slot released", lambda: engine.slots.running == 0)
        assert engine.scheduler.active == 0
        async with session.post(
            url + "/v1/embeddings", json={"input": "x"}, headers={"x-request-id": "e"}
        ) as r:
            await r.read()
        while (event := await stats.next())["request_id"] == "gone":
            assert not event.get("finished")
        assert event["request_id"] == "e"


async def test_s9_50_responses_without_request_id_use_empty_id() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=1, token_delay_ms=0)) as (url, _, session),
        stats_stream(session, url) as stats,
    ):
        async with session.post(url + "/v1/responses", json={"stream": True}) as r:
            await r.read()
        assert (await stats.next())["request_id"] == ""


async def error(response: aiohttp.ClientResponse) -> tuple[int, str]:
    """Status and message of an OpenAI-style JSON error body."""
    assert response.content_type == "application/json"
    return response.status, (await response.json())["error"]["message"]


async def test_body_errors() -> None:
    async with (
        running(max_body_bytes=4096) as (url, _, session),
        session.post(url + "/v1/chat/completions", data=b"{}") as r,
    ):
        assert await error(r) == (415, "expected content-type: application/json")
        headers = {"content-type": "application/json"}
        async with session.post(url + "/v1/chat/completions", data=b"{nope", headers=headers) as r:
            assert (await error(r))[0] == 400
        gzip = {**headers, "content-encoding": "gzip"}
        async with session.post(url + "/v1/chat/completions", data=b"{}", headers=gzip) as r:
            assert await error(r) == (400, "request body is not valid gzip data")
        async with session.post(url + "/v1/chat/completions", json={"messages": "x"}) as r:
            assert await error(r) == (422, "field 'messages' must be an array")
        for field, value in (("max_tokens", -1), ("max_completion_tokens", "x"), ("max_tokens", True)):
            async with session.post(url + "/v1/chat/completions", json=chat(**{field: value})) as r:
                assert await error(r) == (422, f"field {field!r} must be a non-negative integer")
        async with session.post(url + "/v1/embeddings", json={"model": "m"}) as r:
            assert (await error(r))[0] == 422
        deep = b'{"input": ' + b"[" * 300 + b'"hi"' + b"]" * 300 + b"}"  # past what orjson writes
        async with session.post(url + "/v1/responses", data=deep, headers=headers) as r:
            assert await error(r) == (422, "field 'input' must be nested at most 255 levels deep")
        async with session.post(url + "/v1/chat/completions", json={"m": "x" * 5000}) as r:
            assert (await error(r))[0] == 413
        async with session.get(url + "/v1/chat/completions") as r:
            assert (await error(r))[0] == 405 and r.headers["allow"] == "POST"


async def test_request_bodies_are_decoded_as_pylon_decodes_them() -> None:
    """A coding the mock cannot undo is refused, never read as a plain body."""
    body = orjson.dumps(chat(max_tokens=2))
    headers = {"content-type": "application/json"}
    async with running(max_body_bytes=4096) as (url, _, session):
        cases = (
            ("gzip, gzip", gzip.compress(gzip.compress(body)), 200, None),
            ("deflate", zlib.compress(body), 200, None),
            ("zstd2", body, 415, "request bodies with content-encoding 'zstd2' are not supported"),
            ("gzip", gzip.compress(body)[:-6], 400, "request body is truncated gzip data"),
            ("gzip", gzip.compress(gzip.compress(body)), 400, "malformed JSON body: "),  # one layer undone
            ("gzip", gzip.compress(b" " * 5000), 413, "decoded request body exceeds 4096 bytes"),
        )
        for coding, data, status, message in cases:
            sent = {**headers, "content-encoding": coding}
            async with session.post(url + "/v1/chat/completions", data=data, headers=sent) as r:
                if message is None:
                    assert r.status == status and (await r.json())["usage"]["completion_tokens"] == 2
                else:
                    answer = await error(r)
                    assert answer[0] == status and answer[1].startswith(message)
        sent = {**headers, "content-encoding": "br"}
        async with session.put(url + "/test-control/faults", data=b"{}", headers=sent) as r:
            assert r.status == 415


async def test_several_choices_are_refused_and_stop_sequences_ignored() -> None:
    """A client asking for n choices reads n; one, silently, would fail it later."""
    async with running() as (url, _, session):
        for path, body in (("/v1/chat/completions", chat(n=2)), ("/v1/completions", {"prompt": "x", "n": 3})):
            async with session.post(url + path, json=body) as r:
                assert await error(r) == (400, "n > 1 is not supported: the mock engine generates one choice")
        async with session.post(url + "/v1/chat/completions", json=chat(n=True)) as r:
            assert await error(r) == (422, "field 'n' must be a positive integer")
        async with session.post(url + "/v1/chat/completions", json=chat(n=1, stop=[","], max_tokens=3)) as r:
            answer = await r.json()
        assert r.status == 200 and len(answer["choices"]) == 1
        assert answer["usage"]["completion_tokens"] == 3  # the stop sequence cut nothing


@pytest.mark.parametrize("expect", ["", "Expect: 100-continue\r\n"])
async def test_a_body_declared_over_the_limit_is_refused_before_it_is_sent(expect: str) -> None:
    async with running(max_body_bytes=4096) as (url, _, _session):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            f"content-length: 100000\r\n{expect}\r\n"
        )
        writer.write(head.encode())  # and no body: the answer must not wait for it
        status = await asyncio.wait_for(reader.readline(), 5)  # no 100 Continue first
        if expect:  # nor will the body come: the connection ends with the answer
            await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
        assert status.startswith(b"HTTP/1.1 413")


async def test_a_malformed_request_gets_a_json_400_and_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running() as (url, _, _session):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX: \x00\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.0 400") and b"application/json" in answer
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


async def test_backend_id_header_and_fingerprint() -> None:
    async with (
        running(backend_id="engine-7") as (url, _, session),
        session.post(url + "/v1/chat/completions", json=chat()) as r,
    ):
        assert r.headers["x-mock-backend-id"] == "engine-7"
        assert (await r.json())["system_fingerprint"] == "engine-7"
        async with session.get(url + "/health") as r:
            assert r.headers["x-mock-backend-id"] == "engine-7"
    async with running(model="llama") as (url, engine, session), session.get(url + "/health") as r:
        assert r.headers["x-mock-backend-id"] == f"llama/{url.rsplit(':', 1)[1]}" == engine.backend_id


async def test_completions_stream_and_json() -> None:
    async with (
        running(timing=TimingConfig(num_tokens=2, token_delay_ms=0)) as (url, _, session),
        session.post(url + "/v1/completions", json={"prompt": "abc", "stream": True}) as r,
    ):
        frames = await sse(r)
        async with session.post(url + "/v1/completions", json={"prompt": "abc"}) as r:
            body = await r.json()
    texts = [orjson.loads(f.removeprefix(b"data: "))["choices"][0]["text"] for f in frames[:-1]]
    assert texts == ["Hello", ",", ""] and frames[-1] == b"data: [DONE]"
    assert body["choices"][0]["text"] == "Hello," and body["usage"]["prompt_tokens"] == 3
