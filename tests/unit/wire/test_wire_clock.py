from __future__ import annotations

import asyncio

from stargate.wire.clock import ManualClock


async def test_advance_wakes_only_due_sleepers() -> None:
    clock = ManualClock(start=10.0)
    woke: list[str] = []

    async def nap(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append(name)

    tasks = [asyncio.create_task(nap("short", 1.0)), asyncio.create_task(nap("long", 5.0))]
    await clock.sleeping(2)
    clock.advance(2.0)
    await asyncio.sleep(0)
    assert woke == ["short"] and clock.monotonic() == 12.0
    clock.advance(3.0)
    await asyncio.gather(*tasks)
    assert woke == ["short", "long"]


async def test_tick_runs_a_periodic_loop_at_each_deadline() -> None:
    clock = ManualClock(start=0.0)
    beats: list[float] = []

    async def heartbeat() -> None:
        while True:
            beats.append(clock.monotonic())
            await clock.sleep(0.25)

    task = asyncio.create_task(heartbeat())
    await clock.tick(1.0)
    task.cancel()
    assert beats == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert clock.wall_ms() - ManualClock(start=0.0).wall_ms() == 1000


async def test_a_cancelled_sleeper_is_skipped() -> None:
    clock = ManualClock()
    task = asyncio.create_task(clock.sleep(1.0))
    await clock.sleeping(1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert clock.pending == 0
    clock.advance(2.0)
