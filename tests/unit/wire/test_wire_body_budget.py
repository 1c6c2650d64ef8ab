"""The process-wide room for request bodies: all-or-nothing takes, first come first served, bounded waits."""

from __future__ import annotations

import asyncio

import pytest
from support.waiting import until

from stargate.errors import BodyBufferFull, PayloadTooLarge
from stargate.wire.body_budget import BodyBudget


async def waiting(budget: BodyBudget, amount: int) -> asyncio.Task[None]:
    task = asyncio.create_task(budget.take(amount))
    await asyncio.sleep(0)  # one loop turn: the task is queued behind the room it asked for
    assert not task.done()
    return task


def test_takes_fit_or_fail_whole_and_are_given_back() -> None:
    budget = BodyBudget(10, 1.0)
    assert budget.try_take(6) and budget.used == 6
    assert not budget.try_take(5) and budget.used == 6  # nothing taken in part
    assert budget.try_take(4) and budget.used == 10
    budget.give(10)
    assert budget.used == 0


def test_no_cap_takes_anything() -> None:
    budget = BodyBudget(0, None)
    assert budget.try_take(1 << 40) and budget.try_take(1 << 40)


async def test_waiters_are_served_in_arrival_order_and_nobody_overtakes_them() -> None:
    budget = BodyBudget(10, 5.0)
    assert budget.try_take(8)
    big = await waiting(budget, 6)
    small = await waiting(budget, 2)
    assert not budget.try_take(1)  # room for 1 exists, but two callers wait ahead
    budget.give(8)  # 6 then 2: both fit, in order
    await asyncio.gather(big, small)
    assert budget.used == 8


async def test_a_wait_past_its_limit_is_body_buffer_full_and_lets_the_next_one_in() -> None:
    budget = BodyBudget(10, 0.5)  # long enough that the next waiter queues first, however slow the machine
    assert budget.try_take(5)
    stuck = await waiting(budget, 8)
    budget.wait_s = 5.0
    behind = await waiting(budget, 5)  # fits, but queued behind the 8
    with pytest.raises(BodyBufferFull, match="limit of 10 bytes"):
        await stuck
    await behind
    assert budget.used == 10


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing() -> None:
    budget = BodyBudget(10, 5.0)
    assert budget.try_take(10)
    task = await waiting(budget, 4)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    budget.give(10)
    assert budget.used == 0 and budget.try_take(10)


async def test_room_granted_to_a_waiter_cancelled_before_it_ran_is_given_back() -> None:
    budget = BodyBudget(10, 5.0)
    assert budget.try_take(10)
    task = await waiting(budget, 4)
    budget.give(10)  # grants the 4 ...
    assert budget.used == 4
    task.cancel()  # ... to a caller that goes before it could use it
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.used == 0


class _Body:
    """A request body that arrives as the test sends it."""

    def __init__(self, declared: int | None) -> None:
        self.body_exists = True
        self.content_length = declared
        self.content = self
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue()

    def send(self, data: bytes) -> None:
        self._chunks.put_nowait(data)

    async def readany(self) -> bytes:
        return await self._chunks.get()


async def test_a_body_read_whole_holds_its_declared_length_until_it_arrives() -> None:
    budget = BodyBudget(100, 5.0)
    body = _Body(60)
    reading = asyncio.create_task(budget.read_whole(body, 80))  # type: ignore[arg-type]
    await until("room for the declared length", lambda: budget.used == 60)
    body.send(b"x" * 60)
    body.send(b"")
    assert await reading == b"x" * 60 and budget.used == 60  # the caller gives it back when done


async def test_a_body_that_stalls_gives_back_the_room_it_has_not_filled() -> None:
    """Forty connections that declared 64 MiB and sent a byte every 20 s held all of a Pylon's room."""
    budget = BodyBudget(100, 5.0, stall_s=0.05)
    slow = _Body(90)
    reading = asyncio.create_task(budget.read_whole(slow, 100))  # type: ignore[arg-type]
    slow.send(b"x" * 10)
    await until("the unfilled room given back", lambda: budget.used == 10)  # 90, then what came
    assert budget.try_take(85)  # another body fits now
    # What it sends from then on takes room at once, past the cap if need be (up to twice it): a
    # body that waited halfway could wait for others waiting halfway for it.
    slow.send(b"y" * 20)
    slow.send(b"")
    assert await reading == b"x" * 10 + b"y" * 20 and budget.used == 115
    budget.give(115)
    assert budget.take_arrived(200) and not budget.take_arrived(1)


async def test_a_body_of_unknown_length_holds_only_what_it_sent() -> None:
    """Chunked uploads that sent a few bytes and went quiet each held the whole cap ahead, and every
    other body waited behind them."""
    budget = BodyBudget(100, 5.0, stall_s=60.0)  # no stall window ends within the test
    idle = _Body(None)
    reading = asyncio.create_task(budget.read_whole(idle, 80))  # type: ignore[arg-type]
    idle.send(b"x" * 5)
    await until("the bytes that came held", lambda: budget.used == 5)
    assert budget.try_take(95)  # a declared body takes the rest at once
    idle.send(b"y" * 10)
    idle.send(b"")
    assert await reading == b"x" * 5 + b"y" * 10 and budget.used == 110


async def test_a_waiter_cancelled_while_room_is_given_back_is_skipped_not_granted() -> None:
    """Waits that timed out together: a give() in between granted the cancelled waiter (a 500 and
    room lost for good)."""
    budget = BodyBudget(10, 5.0)
    assert budget.try_take(10)
    gone = await waiting(budget, 4)
    behind = await waiting(budget, 6)
    gone.cancel()  # its wait ends now; its task leaves the queue only when it next runs
    budget.give(10)
    with pytest.raises(asyncio.CancelledError):
        await gone
    await behind
    assert budget.used == 6 and budget.waiting == 0


async def test_a_body_past_its_cap_is_too_large_and_holds_nothing() -> None:
    budget = BodyBudget(100, 5.0)
    chunked = _Body(None)
    reading = asyncio.create_task(budget.read_whole(chunked, 50))  # type: ignore[arg-type]
    chunked.send(b"x" * 40)
    chunked.send(b"x" * 20)
    with pytest.raises(PayloadTooLarge, match="larger than 50 bytes"):
        await reading
    assert budget.used == 0
