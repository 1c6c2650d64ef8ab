"""The process-wide room for request bodies: all-or-nothing takes, first come first served, bounded waits."""

from __future__ import annotations

import asyncio

import pytest

from stargate.errors import BodyBufferFull
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
