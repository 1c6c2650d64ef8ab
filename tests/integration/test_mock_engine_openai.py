"""The real ``openai`` AsyncOpenAI client against a live mock engine process on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest
from openai import AsyncOpenAI

from stargate.mock_engine.cli import LISTEN_LINE


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    command = [sys.executable, "-m", "stargate.mock_engine.cli", "--port", "0", "--model", "llama",
               "--token-delay-ms", "1", "--num-tokens", "4", "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(LISTEN_LINE), line
        yield line[len(LISTEN_LINE) :].strip()
    finally:
        process.terminate()
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        finally:
            if process.stdout is not None:
                process.stdout.close()
        assert code == 0


@contextlib.asynccontextmanager
async def client(url: str) -> AsyncIterator[AsyncOpenAI]:
    openai_client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        yield openai_client
    finally:
        await openai_client.close()


async def test_chat_non_streaming(server_url: str) -> None:
    async with client(server_url) as openai_client:
        completion = await openai_client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert completion.choices[0].message.content == "Hello, how"
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    assert completion.system_fingerprint is not None and completion.system_fingerprint.startswith("llama/")


async def test_chat_streaming_with_usage(server_url: str) -> None:
    async with client(server_url) as openai_client:
        stream = await openai_client.chat.completions.create(
            model="llama",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, how can"
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 4
    )


async def test_raw_response_headers_report_kv_ground_truth(server_url: str) -> None:
    async with client(server_url) as openai_client:
        raw = await openai_client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-input-tokens": "9"}
        )
    assert raw.headers["x-kv-cache-hit"] == "false"
    assert raw.headers["x-kv-cache-uncached-input-tokens"] == "9"
    assert raw.headers["x-mock-backend-id"].startswith("llama/")


async def test_completions_embeddings_and_models(server_url: str) -> None:
    async with client(server_url) as openai_client:
        completion, embedding, models = await asyncio.gather(
            openai_client.completions.create(model="llama", prompt="abc", max_tokens=2),
            openai_client.embeddings.create(model="llama", input=["a", "b"]),
            openai_client.models.list(),
        )
    assert completion.choices[0].text == "Hello,"
    assert [item.index for item in embedding.data] == [0, 1]
    assert [model.id for model in models.data] == ["llama"]


async def test_responses_streaming(server_url: str) -> None:
    async with client(server_url) as openai_client:
        stream = await openai_client.responses.create(model="llama", input="hello", stream=True)
        events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello, how can"
