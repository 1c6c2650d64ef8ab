"""`WatchPublisher` (spec §5.7): changes reach every stream, heartbeats repeat the current snapshot."""

from __future__ import annotations

import asyncio

from stargate.proto import stargate_pb2 as pb
from stargate.router.watch import WatchPublisher
from stargate.wire.clock import ManualClock

FOREVER_S = 3600.0


def snapshot(*ids: str) -> pb.WatchStargatesResponse:
    infos = [pb.StargateInfo(stargate_id=i, advertise_addr=i) for i in ids]
    return pb.WatchStargatesResponse(stargates=infos)


def test_offer_publishes_only_changed_content() -> None:
    publisher = WatchPublisher(snapshot("a"), heartbeat_s=FOREVER_S)
    assert not publisher.offer(snapshot("a"))
    assert publisher.offer(snapshot("a", "b"))
    assert not publisher.offer(snapshot("a", "b"))
    assert publisher.snapshot == snapshot("a", "b")


async def test_streams_get_the_current_snapshot_then_every_publication_and_end_on_stop() -> None:
    publisher = WatchPublisher(snapshot("a"), heartbeat_s=FOREVER_S)
    stopping = asyncio.Event()
    streams = [publisher.stream(stopping) for _ in range(2)]
    assert [await anext(s) for s in streams] == [snapshot("a")] * 2
    pending = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0)
    assert not any(p.done() for p in pending)
    publisher.offer(snapshot("a", "b"))
    assert await asyncio.gather(*pending) == [snapshot("a", "b")] * 2
    publisher.offer(snapshot("b"))  # published while no stream was waiting: still delivered
    assert [await anext(s) for s in streams] == [snapshot("b")] * 2
    stopping.set()
    for s in streams:
        assert [m async for m in s] == []


async def test_a_quiet_stream_repeats_the_snapshot_every_heartbeat() -> None:
    clock = ManualClock()
    publisher = WatchPublisher(snapshot("a"), heartbeat_s=5.0, clock=clock)
    stopping = asyncio.Event()
    stream = publisher.stream(stopping)
    assert await anext(stream) == snapshot("a")
    for _ in range(2):
        following = asyncio.ensure_future(anext(stream))
        await clock.sleeping(1)
        clock.advance(4.99)
        await asyncio.sleep(0)
        assert clock.pending == 1 and not following.done()  # not before the heartbeat
        clock.advance(0.01)
        assert await following == snapshot("a")
    stopping.set()


async def test_an_empty_snapshot_is_not_sent_at_once() -> None:
    publisher = WatchPublisher(pb.WatchStargatesResponse(), heartbeat_s=FOREVER_S)
    stopping = asyncio.Event()
    stream = publisher.stream(stopping)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not first.done()
    publisher.offer(snapshot("a"))
    assert await first == snapshot("a")
    stopping.set()
