"""The real ``openai`` SDK against ``stargate-bench serve`` (Stargate + Pylon + mock engine processes).

Plain-client mode on: no extra headers, every endpoint a load tool uses. Mode off: the spec's
header contract exactly as before (non-streaming chat refused by Pylon, no /v1/completions, the
``model_ids``-only models mirror).
"""

from __future__ import annotations

import gzip
import io
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from stargate.bench.fleet import command
from stargate.bench.procs import ManagedProcess, stop_all

MODEL = "mock-model"
READY_TIMEOUT_S = 60.0
HEADERS = {"x-request-id": "spec-1", "x-model": MODEL, "x-input-tokens": "8"}
MESSAGES: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def parse_base_url(line: str) -> str | None:
    return line.removeprefix("OPENAI_BASE_URL=") if line.startswith("OPENAI_BASE_URL=") else None


async def start_fleet(tmp_path: Path, *extra: str) -> tuple[ManagedProcess[str], str]:
    # The engine caches by the cache-affinity key a request reaches it with: a hit shows the key.
    argv = [*command("stargate-bench"), "serve", "--engines", "1", "--kv-cache-mode", "affinity",
            "--out", str(tmp_path / "fleet"), *extra]  # fmt: skip
    proc = ManagedProcess("serve", argv, tmp_path, parse_base_url)
    await proc.start()
    try:
        return proc, await proc.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        await stop_all([proc])
        raise


@pytest.fixture
async def plain(tmp_path: Path) -> AsyncIterator[str]:
    proc, url = await start_fleet(tmp_path)
    try:
        yield url
    finally:
        await stop_all([proc], grace_s=10.0)
    assert proc.returncode == 0, proc.log_tail()


@pytest.fixture
async def spec(tmp_path: Path) -> AsyncIterator[str]:
    proc, url = await start_fleet(tmp_path, "--plain-clients", "false")
    try:
        yield url
    finally:
        await stop_all([proc], grace_s=10.0)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=20)


async def test_plain_client_mode_serves_the_openai_sdk_without_headers(plain: str) -> None:
    async with sdk(plain) as client:
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert chat.choices[0].message.content and chat.usage is not None
        assert chat.usage.completion_tokens == 4
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces).strip()

        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
        assert response.output_text.strip()
        events = await client.responses.create(model=MODEL, input="hi", stream=True)
        kinds = [event.type async for event in events]
        assert kinds[-1] == "response.completed"
        # The SDK's stream helper rebuilds the response from the item and part events.
        async with client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as helper:
            texts = [event.delta async for event in helper if event.type == "response.output_text.delta"]
            final = await helper.get_final_response()
        assert final.output_text == "".join(texts) and final.output_text.strip()

        completion = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert completion.choices[0].text.strip()
        streamed = await client.completions.create(model=MODEL, prompt="hello", max_tokens=3, stream=True)
        texts = [c.choices[0].text async for c in streamed if c.choices]
        assert "".join(texts).strip()

        embeddings = await client.embeddings.create(model=MODEL, input=["a", "b"])
        assert [item.index for item in embeddings.data] == [0, 1]

        assert [m.id async for m in client.models.list()] == [MODEL]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("no-such-model")
        with pytest.raises(openai.NotFoundError) as long_id:  # quoted short, not echoed whole
            await client.models.retrieve("m" * 7000)
        assert len(long_id.value.message) < 250 and "is not served" in long_id.value.message

        # The id the router gave a request reaches the client, relayed answer or its own error.
        assert chat._request_id is not None and chat._request_id.startswith("sg-")
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="no-such-model", messages=MESSAGES)
        assert unknown.value.request_id is not None and unknown.value.request_id.startswith("sg-")
        sent = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_headers={"x-request-id": "client-7"}
        )
        assert sent._request_id == "client-7"

        # prompt_cache_key is the cache-affinity key, before user: the second request of the
        # conversation, sent for another user, hits the KV cache the first left on its engine.
        hits = []
        for user in ("alice", "bob"):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, prompt_cache_key="conversation-1", user=user
            )
            hits.append(raw.headers["x-kv-cache-hit"])
        assert hits == ["false", "true"]
        # Keys no header can carry as they are (too long for a header line, not ASCII) still work.
        for key in ("k" * 9000, "jos\u00e9"):
            hits = []
            for _ in range(2):
                raw = await client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=MESSAGES, max_tokens=2, user=key
                )
                hits.append(raw.headers["x-kv-cache-hit"])
            assert hits == ["false", "true"], key

        with pytest.raises(openai.BadRequestError) as missing:
            await client.chat.completions.create(model="", messages=MESSAGES)
        assert "names no model" in str(missing.value)  # the SDK's message says what was wrong


async def test_a_conversation_sent_without_a_key_keeps_one_from_turn_to_turn(plain: str) -> None:
    system: openai.types.chat.ChatCompletionMessageParam = {
        "role": "system", "content": "You answer briefly and check your work. " * 30  # past one block
    }

    async with sdk(plain) as client:

        async def turn(messages: list[openai.types.chat.ChatCompletionMessageParam]) -> tuple[str, str]:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=3
            )
            return raw.headers["x-kv-cache-hit"], raw.parse().choices[0].message.content or ""

        messages = [system, {"role": "user", "content": "first question"}]
        hits = []
        for question in ("second question", "third question"):
            hit, answer = await turn(messages)
            hits.append(hit)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        hits.append((await turn(messages))[0])
        # Each turn reached the engine with the key of the turn before: its cache is there.
        assert hits == ["false", "true", "true"]
        # Another conversation with the same system prompt is not that one: a key of its own.
        hit, _ = await turn([system, {"role": "user", "content": "an unrelated question"}])
        assert hit == "false"


async def test_answers_are_as_long_as_the_client_asks_up_to_the_flag(tmp_path: Path) -> None:
    proc, url = await start_fleet(tmp_path, "--max-output-tokens", "90", "--batching", "vllm")
    try:
        async with sdk(url) as client:
            asked = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=70)
            unlimited = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
            capped = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=500)
        lengths = [c.usage.completion_tokens if c.usage else None for c in (asked, unlimited, capped)]
        assert lengths == [70, 90, 90]
    finally:
        await stop_all([proc], grace_s=10.0)
    assert proc.returncode == 0, proc.log_tail()


async def test_plain_client_mode_fills_headers_and_keeps_sent_ones(plain: str) -> None:
    base = plain.removesuffix("/v1")
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.get(base + "/health") as resp:
            assert resp.status == 200
        # The body's user is the cache-affinity key: the second request hits the engine's KV cache.
        hits = []
        for _ in range(2):
            async with http.post(plain + "/chat/completions", json={**chat, "user": "alice"}) as resp:
                assert resp.status == 200, await resp.text()
                hits.append(resp.headers["x-kv-cache-hit"])
                # 11 prompt bytes at 4 bytes per token.
                assert resp.headers["x-mock-input-tokens"] == "3"
        assert hits == ["false", "true"]
        # A gzip body is read decoded by the router and Pylon and reaches the engine still compressed.
        packed = gzip.compress(orjson.dumps(chat))
        headers = {"content-encoding": "gzip", "content-type": "application/json"}
        async with http.post(plain + "/chat/completions", data=packed, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["x-mock-input-tokens"] == "3"
        # A header-complete request is forwarded unparsed: the router does not look at this body.
        async with http.post(plain + "/chat/completions", data=b"not json", headers=HEADERS) as resp:
            assert resp.status == 400
            assert "valid JSON" in (await resp.json(content_type=None))["detail"]
        # The body is read only up to its bound.
        big = orjson.dumps({"model": MODEL, "prompt": "x" * (9 * 1024 * 1024)})
        async with http.post(plain + "/completions", data=io.BytesIO(big)) as resp:
            assert resp.status == 413
            assert "--plain-client-max-body-bytes" in await resp.text()


async def test_mode_off_keeps_the_spec_contract(spec: str) -> None:
    base = spec.removesuffix("/v1")
    async with sdk(spec) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_headers=HEADERS
        )
        assert [c async for c in stream]
        with pytest.raises(openai.BadRequestError):  # Pylon: stream=true required
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_headers=HEADERS)
        with pytest.raises(openai.BadRequestError) as missing:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)
        assert "missing required header x-request-id" in str(missing.value)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model=MODEL, prompt="hello", extra_headers=HEADERS)
        embeddings = await client.embeddings.create(model=MODEL, input="a", extra_headers=HEADERS)
        assert len(embeddings.data) == 1
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve(MODEL)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        async with http.get(spec + "/models") as resp:
            assert await resp.json() == {"model_ids": [MODEL]}
        async with http.get(base + "/health") as resp:
            assert resp.status == 404
