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
