"""Registration message contents and generation visibility (spec pylon.md §9, §14 items 113, 116, 117)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from types import MappingProxyType

import pytest

from stargate.balancer.types import ModelStats
from stargate.proto import stargate_pb2
from stargate.pylon.load import Phase
from stargate.pylon.models import Generation, ModelRegistry, ModelStatus
from stargate.pylon.registration import (
    LATE_S,
    WATCH_SILENCE_FLOOR_S,
    RouterInfo,
    Silent,
    each_within,
    router_from_info,
    stats_to_proto,
    watch_silence_s,
)
from stargate.pylon.stats.hub import ConcurrencyUpdate, LimitSource
from stargate.wire.limits import U64_MAX

from .helpers import make_rig


def test_b113_router_identity_and_dial_address() -> None:
    info = stargate_pb2.StargateInfo(advertise_addr="10.0.0.1:50071")
    assert router_from_info(info) == RouterInfo("10.0.0.1:50071", "10.0.0.1:50071", "http://10.0.0.1:50071")
    dial = stargate_pb2.StargateInfo(
        stargate_id="sg-7", advertise_addr="sg-7.example:50071", grpc_pylon_dial_addr="127.0.0.1:6000"
    )
    assert router_from_info(dial) == RouterInfo(
        "sg-7.example:50071", "sg-7.example:50071", "http://127.0.0.1:6000"
    )
    assert router_from_info(stargate_pb2.StargateInfo(stargate_id="sg-8")) == RouterInfo(
        "sg-8", "sg-8", "http://sg-8"
    )
    assert router_from_info(stargate_pb2.StargateInfo()) is None


def test_a_router_is_the_same_whichever_replica_lists_it() -> None:
    """A replica lists itself under its --stargate-id, its peers list it under its address."""
    itself = stargate_pb2.StargateInfo(stargate_id="sg-1", advertise_addr="10.0.0.1:50071")
    by_peer = stargate_pb2.StargateInfo(stargate_id="10.0.0.1:50071", advertise_addr="10.0.0.1:50071")
    assert router_from_info(itself) == router_from_info(by_peer)


def test_b116_registration_carries_estimates_and_limit() -> None:
    stats = ModelStats(
        queue_time_estimate_ms_by_priority=MappingProxyType({0: 11, 2: 7}), max_engine_concurrency=11
    )
    proto = stats_to_proto(stats)
    assert dict(proto.queue_time_estimate_ms_by_priority) == {0: 11, 2: 7}
    assert proto.max_engine_concurrency == 11
    unknown = stats_to_proto(ModelStats())
    assert unknown.max_engine_concurrency == 0 and dict(unknown.queue_time_estimate_ms_by_priority) == {}
    r = make_rig(initial_input_tps=1000, limit=11)
    r.load.track("q0", r.gen, 0, 11)
    r.load.track("q2", r.gen, 2, 7)
    published = stats_to_proto(r.hub.snapshot(r.gen))
    assert published.max_engine_concurrency == 11
    assert dict(published.queue_time_estimate_ms_by_priority) == {0: 11, 2: 18}


def test_b117_pending_omitted_retired_cannot_publish_or_update() -> None:
    registry = ModelRegistry()
    pending = registry.allocate("a")
    assert registry.published() == [] and registry.admitted("a") is None
    assert registry.publish(pending)
    assert registry.published() == [(pending, ModelStatus.ACTIVE)]
    assert registry.retire("a") == pending
    assert not registry.publish(pending) and registry.published() == []
    newer = registry.allocate("a")
    assert newer.seq > pending.seq and not registry.publish(Generation("a", pending.seq))
    assert registry.published() == []  # the re-added model is pending again
    assert registry.publish(newer)
    registry.set_bringup_ready(pending, False)  # an update for the retired generation is ignored
    assert registry.published() == [(newer, ModelStatus.ACTIVE)]

    r = make_rig(limit=5)
    old = r.gen
    r.hub.retire_generation(old)
    r.registry.retire(old.model_id)
    assert not r.hub.apply_concurrency(ConcurrencyUpdate(old, LimitSource.ENGINE, 40))
    assert r.hub.snapshot(old) == ModelStats()


def test_heartbeat_building_saturates_every_u64_field() -> None:
    r = make_rig(initial_input_tps=1000, limit=11)
    for index in range(6):
        r.load.track(f"huge-{index}", r.gen, 0, U64_MAX)  # six valid x-input-tokens: 2^64-1
    published = stats_to_proto(r.hub.snapshot(r.gen))
    assert published.total_query_input_size == U64_MAX and published.queued_input_size == U64_MAX
    assert set(published.queue_time_estimate_ms_by_priority.values()) == {U64_MAX}
    absurd = ModelStats(
        queue_size=2**70,
        num_running_queries=-1,
        stats_observed_at_unix_ms=2**65,
        queue_time_estimate_ms_by_priority=MappingProxyType({2**40: 2**70, 3: 5}),
    )
    proto = stats_to_proto(absurd)
    assert (proto.queue_size, proto.num_running_queries) == (U64_MAX, 0)
    assert proto.stats_observed_at_unix_ms == U64_MAX
    assert dict(proto.queue_time_estimate_ms_by_priority) == {2**32 - 1: U64_MAX, 3: 5}


def test_every_change_of_pylons_own_load_asks_for_a_prompt_publication() -> None:
    r = make_rig()
    changes: list[int] = []
    r.hub.on_change = lambda: changes.append(r.clock.wall_ms())
    r.load.track("a", r.gen, 0, 5)
    r.load.advance("a", Phase.INPUT_PROCESSING)
    r.load.advance("a", Phase.INPUT_PROCESSING)  # no change: phases only move forward
    r.load.advance("a", Phase.OUTPUT_GENERATION)
    r.load.release("a")
    r.load.release("a")  # already gone
    assert len(changes) == 4
    r.clock.advance(2.0)
    r.load.track("b", r.gen, 0, 5)
    assert r.hub.snapshot(r.gen).stats_observed_at_unix_ms == changes[-1]


def test_a_watch_may_be_silent_for_three_of_the_heartbeats_stargate_says_it_sends() -> None:
    """A fixed 60 s reopened the watch of a Stargate sending one every 90 s, once a minute."""
    said = [("x-stargate-watch-heartbeat-ms", "200000")]
    assert watch_silence_s(said, 300.0) == 600.0
    assert watch_silence_s([("x-stargate-watch-heartbeat-ms", "20")], 300.0) == WATCH_SILENCE_FLOOR_S
    assert watch_silence_s([("other", "1")], 123.0) == 123.0  # the original's Stargate says nothing
    assert watch_silence_s([("x-stargate-watch-heartbeat-ms", "-5")], 123.0) == 123.0
    assert watch_silence_s(None, 123.0) == 123.0


async def test_a_stream_is_not_silent_for_the_time_this_process_was_paused() -> None:
    """A Pylon paused past the silence bound (SIGSTOP, a paused VM) tore its streams down on resume,
    blaming Stargate, with Stargate's messages unread in its buffers: here the message is read a
    moment after the late timer, as gRPC delivers it."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Queue[str] = asyncio.Queue()

    async def messages() -> AsyncIterator[str]:
        while True:
            yield await arrived.get()

    def pause() -> None:
        time.sleep(0.2 + LATE_S + 0.3)  # the whole process stops: no timer, no read
        loop.call_later(0.3, arrived.put_nowait, "snapshot")

    stream = each_within(messages(), 0.2, "snapshot")
    loop.call_soon(pause)
    assert await anext(stream) == "snapshot"
    with pytest.raises(Silent, match=r"no snapshot within 0\.2 s"):  # not paused: silent
        await anext(stream)
    await stream.aclose()


async def test_a_read_that_ends_in_the_calls_error_as_it_is_cancelled_is_not_logged() -> None:
    """asyncio logged "Task exception was never retrieved" with a gRPC traceback when a Pylon
    closed its streams as Stargate shut them down."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))

    acked, failed = asyncio.Event(), asyncio.Event()

    async def call() -> AsyncIterator[str]:
        yield "ack"
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            failed.set()
            raise RuntimeError("the call's own error") from None

    async def consume() -> None:
        async for _ack in each_within(call(), 60.0, "ack"):
            acked.set()

    consumer = asyncio.ensure_future(consume())
    await acked.wait()
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    del consumer  # with its traceback, the last reference to the read
    await failed.wait()  # the read ended in the call's error in the step that set it
    await asyncio.sleep(0)  # one loop turn: that step's task is released, and logged if unretrieved
    gc.collect()
    loop.set_exception_handler(None)
    assert unretrieved == []
