"""ReplayBody: a declared-length body is read whole and sent as bytes; failures still stream."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import pytest

from stargate.router.replay import Readiness, ReplayBody


async def chunks(*parts: bytes, error: Exception | None = None) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if error is not None:
        raise error


async def drain(body: bytes | AsyncIterable[bytes]) -> bytes:
    if isinstance(body, bytes):
        return body
    return b"".join([chunk async for chunk in body])


async def test_declared_length_body_is_read_whole_and_replayable() -> None:
    replay = ReplayBody(chunks(b"ab", b"cd"), 100, length=4)
    assert await replay.next_body() == b"abcd"
    assert replay.readiness() is Readiness.READY and replay.buffered == 4
    assert await replay.next_body() == b"abcd"


async def test_undeclared_length_body_still_streams() -> None:
    replay = ReplayBody(chunks(b"ab", b"cd"), 100)
    body = await replay.next_body()
    assert not isinstance(body, bytes)
    assert replay.readiness() is Readiness.READY  # not consumed yet
    assert await drain(body) == b"abcd"
    assert await replay.next_body() == b"abcd"


async def test_failed_read_streams_what_arrived_then_raises() -> None:
    replay = ReplayBody(chunks(b"ab", error=ConnectionResetError("gone")), 100, length=4)
    body = await replay.next_body()
    assert replay.readiness() is Readiness.INCOMPLETE
    assert not isinstance(body, bytes)
    received: list[bytes] = []
    with pytest.raises(ConnectionResetError):
        async for chunk in body:
            received.append(chunk)
    assert received == [b"ab"] and replay.readiness() is Readiness.INCOMPLETE


async def test_body_over_the_limit_streams_on_and_is_not_replayable() -> None:
    replay = ReplayBody(chunks(b"abc", b"def", b"gh"), 4, length=8)
    body = await replay.next_body()
    assert await drain(body) == b"abcdefgh"
    assert replay.readiness() is Readiness.PAYLOAD_TOO_LARGE


async def test_no_body_is_empty_bytes() -> None:
    assert await ReplayBody(None, 10, length=0).next_body() == b""
