"""`WatchPublisher` (spec §5.7): publish on change or after the heartbeat, every stream sees each."""

from __future__ import annotations

import asyncio

from stargate.proto import stargate_pb2 as pb
from stargate.router.watch import WatchPublisher


def snapshot(*ids: str) -> pb.WatchStargatesResponse:
    return pb.WatchStargatesResponse(
        stargates=[pb.StargateInfo(stargate_id=i, advertise_addr=i) for i in ids]
    )


def test_offer_publishes_changes_at_once_and_identical_content_only_after_the_heartbeat() -> None:
    publisher = WatchPublisher(snapshot("a"), heartbeat_s=5.0, now=100.0)
    assert not publisher.offer(snapshot("a"), 104.9)
    assert publisher.offer(snapshot("a", "b"), 104.0)
    assert publisher.next_heartbeat() == 109.0
    assert not publisher.offer(snapshot("a", "b"), 108.9)
    assert publisher.offer(snapshot("a", "b"), 109.0)
    assert publisher.snapshot == snapshot("a", "b")


async def test_streams_get_the_current_snapshot_then_every_publication_and_end_on_stop() -> None:
    publisher = WatchPublisher(snapshot("a"), heartbeat_s=5.0, now=0.0)
    stopping = asyncio.Event()
    streams = [publisher.stream(stopping) for _ in range(2)]
    assert [await anext(s) for s in streams] == [snapshot("a")] * 2
    pending = [asyncio.ensure_future(anext(s)) for s in streams]
    await asyncio.sleep(0)
    assert not any(p.done() for p in pending)
    publisher.offer(snapshot("a", "b"), 1.0)
    assert await asyncio.gather(*pending) == [snapshot("a", "b")] * 2
    publisher.offer(snapshot("b"), 2.0)  # published while no stream was waiting: still delivered
    assert [await anext(s) for s in streams] == [snapshot("b")] * 2
    stopping.set()
    for s in streams:
        assert [m async for m in s] == []


async def test_an_empty_snapshot_is_not_sent_at_once() -> None:
    publisher = WatchPublisher(pb.WatchStargatesResponse(), heartbeat_s=5.0, now=0.0)
    stopping = asyncio.Event()
    stream = publisher.stream(stopping)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not first.done()
    publisher.offer(snapshot("a"), 1.0)
    assert await first == snapshot("a")
    stopping.set()
