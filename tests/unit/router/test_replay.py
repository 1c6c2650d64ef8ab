"""The replay buffer's bytes in the router's body budget: taken as kept, given back when dropped or done."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from stargate.router.replay import Readiness, ReplayBody
from stargate.wire.body_budget import BodyBudget


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def sent(body: bytes | AsyncIterable[bytes]) -> bytes:
    if isinstance(body, bytes):
        return body
    return b"".join([chunk async for chunk in body])


async def test_a_kept_body_holds_its_bytes_until_released() -> None:
    budget = BodyBudget(100, 1.0)
    replay = ReplayBody(chunks(b"abc", b"de"), 1000, budget)
    assert await sent(replay.body()) == b"abcde"
    assert budget.used == 5 and replay.readiness() is Readiness.READY
    assert replay.body() == b"abcde" and budget.used == 5  # the resent copy replaces the buffer
    replay.release()
    replay.release()
    assert budget.used == 0


async def test_a_body_without_room_is_sent_whole_and_not_kept() -> None:
    budget = BodyBudget(4, 1.0)
    replay = ReplayBody(chunks(b"abc", b"de", b"f"), 1000, budget)
    assert await sent(replay.body()) == b"abcdef"  # the client's bytes all go on
    assert budget.used == 0 and replay.buffered == 0
    assert replay.readiness() is Readiness.INCOMPLETE  # not replayable, but not too large either


async def test_a_body_over_the_limit_gives_its_room_back() -> None:
    budget = BodyBudget(100, 1.0)
    replay = ReplayBody(chunks(b"abc", b"def"), 4, budget)
    assert await sent(replay.body()) == b"abcdef"
    assert budget.used == 0 and replay.readiness() is Readiness.PAYLOAD_TOO_LARGE


async def test_a_body_read_whole_is_resent_as_is_and_its_room_given_back() -> None:
    budget = BodyBudget(100, 1.0)
    body = b'{"model": "m"}'
    assert budget.try_take(len(body))  # what the plain-client reader took
    replay = ReplayBody.read(body, budget)
    assert replay.body() is body and replay.body() is body and replay.readiness() is Readiness.READY
    replay.release()
    assert budget.used == 0


async def test_a_body_read_ahead_is_sent_as_its_chunks_then_resent_whole() -> None:
    budget = BodyBudget(100, 1.0)
    replay = ReplayBody(chunks(b"abc", b"de"), 1000, budget)
    await replay.read_ahead()
    assert budget.used == 5 and replay.readiness() is Readiness.READY
    first = replay.body()
    assert not isinstance(first, bytes)
    assert [chunk async for chunk in first] == [b"abc", b"de"]  # as received, never re-split
    assert replay.body() == b"abcde" and budget.used == 5
    replay.release()
    assert budget.used == 0


async def test_read_ahead_stops_where_the_buffer_stops_keeping_and_the_send_streams_the_rest() -> None:
    over_limit = ReplayBody(chunks(b"abc", b"def", b"g"), 4, BodyBudget(100, 1.0))
    await over_limit.read_ahead()
    assert over_limit.buffered == 3 and over_limit.readiness() is Readiness.READY  # not sent yet
    assert await sent(over_limit.body()) == b"abcdefg"
    assert over_limit.readiness() is Readiness.PAYLOAD_TOO_LARGE and over_limit.buffered == 0
    budget = BodyBudget(4, 1.0)
    no_room = ReplayBody(chunks(b"abc", b"de", b"f"), 1000, budget)
    await no_room.read_ahead()
    assert await sent(no_room.body()) == b"abcdef"
    assert no_room.readiness() is Readiness.INCOMPLETE and budget.used == 0
