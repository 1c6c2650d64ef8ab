"""Concurrency slots of the mock engine: FIFO hand-over and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from stargate.mock_engine.engine import Slots


async def test_a_waiter_cancelled_in_the_tick_its_slot_frees_leaves_the_counts_right() -> None:
    # A client that hangs up while queued, as a slot frees: the release skips its cancelled waiter,
    # and the waiter's own cleanup must not fail to find itself (it raised ValueError, a traceback).
    slots = Slots(limit=1, max_waiting=10)
    await slots.acquire()
    queued = asyncio.create_task(slots.acquire())
    while slots.waiting == 0:
        await asyncio.sleep(0)
    queued.cancel()
    slots.release()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert (slots.running, slots.waiting) == (0, 0)
    await slots.acquire()  # the freed slot is taken at once
    assert slots.running == 1
