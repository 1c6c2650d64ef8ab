"""`ListModels` and `WatchStargates` over real grpc.aio servers on loopback (conformance 95, 96, 137, 138)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest
from grpc import aio
from support.stargate_harness import running

from stargate.balancer.types import ModelStats
from stargate.errors import ConfigError
from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc
from stargate.router.control_plane import ControlPlane, ControlPlaneSettings
from stargate.router.state import RoutingState
from stargate.wire.clock import ManualClock

CALL_TIMEOUT_S = 10.0
MS = 1_000_000


def settings(**overrides: object) -> ControlPlaneSettings:
    values: dict[str, object] = {
        "stargate_id": "sg-1",
        "advertise_addr": "127.0.0.1:0",
        "http_advertise_addr": "127.0.0.1:8000",
    }
    values.update(overrides)
    return ControlPlaneSettings(**values)  # type: ignore[arg-type]


def populate(state: RoutingState) -> None:
    for server_id, routing_key, models in (
        ("a", None, ("model-z", "model-b")),
        ("b", "rk-list-a", ("model-ka",)),
        ("c", "rk-list-b", ("model-kb",)),
    ):
        handle = state.admit(server_id, f"http://{server_id}:1", "", routing_key)
        assert handle is not None
        state.apply_update(handle, dict.fromkeys(models, ModelStats()), MS)


async def test_95_96_list_models_on_a_separate_discovery_listener() -> None:
    state = RoutingState()
    populate(state)
    async with aiohttp.ClientSession() as session:
        plane = ControlPlane(state, settings(), session)
        control_port, discovery_port = await plane.start("127.0.0.1:0", "localhost:0")
        assert control_port != discovery_port
        try:
            async with aio.insecure_channel(f"localhost:{discovery_port}") as channel:
                stub = stargate_pb2_grpc.StargateModelDiscoveryStub(channel)

                async def listed(**fields: object) -> list[str]:
                    request = pb.ListModelsRequest(**fields)  # type: ignore[arg-type]
                    return list((await stub.ListModels(request, timeout=CALL_TIMEOUT_S)).model_ids)

                assert await listed() == ["model-b", "model-z"]
                assert await listed(routing_key="  ") == ["model-b", "model-z"]
                assert await listed(routing_key=" rk-list-a ") == ["model-ka"]
                assert await listed(routing_key="rk-unknown") == []
                assert await listed(model_ids=[" model-z ", "model-ka", "model-z"]) == ["model-z"]
                with pytest.raises(aio.AioRpcError) as info:
                    await listed(model_ids=["model-z", " "])
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == "model_ids must not contain empty values"
                watch_stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)
                with pytest.raises(aio.AioRpcError) as info:
                    await watch_stub.WatchStargates(pb.WatchStargatesRequest(), timeout=CALL_TIMEOUT_S).read()
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await plane.stop(0.5)


async def test_138_watch_self_only_snapshot_repeats_every_heartbeat() -> None:
    state = RoutingState()
    remote = ("http://peer-b:50071", " peer-a:50071 ", "", "http://PEER-B:50071/x", "127.0.0.1:0")
    clock = ManualClock()
    async with aiohttp.ClientSession() as session:
        plane = ControlPlane(
            state,
            settings(watch_heartbeat_ms=20, remote_stargate_urls=remote, grpc_pylon_dial_addr=" 10.1.1.1:7 "),
            session,
            clock=clock,
        )
        port, same_port = await plane.start("127.0.0.1:0", "127.0.0.1:0")
        assert port == same_port
        assert plane.advertise_addr == f"127.0.0.1:{port}"
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)
                models = await stargate_pb2_grpc.StargateModelDiscoveryStub(channel).ListModels(
                    pb.ListModelsRequest(), timeout=CALL_TIMEOUT_S
                )
                assert list(models.model_ids) == []
                call = stub.WatchStargates(pb.WatchStargatesRequest(), timeout=CALL_TIMEOUT_S)
                # The heartbeat is said, so Pylon can tell a silent connection from a quiet one.
                assert dict(await call.initial_metadata())["x-stargate-watch-heartbeat-ms"] == "20"
                snapshots = [await call.read()]
                for _ in range(2):
                    await clock.sleeping(2)  # the discovery poll and this stream's heartbeat
                    clock.advance(0.019)
                    await asyncio.sleep(0)
                    assert clock.pending == 2  # no heartbeat before 20 ms
                    clock.advance(0.001)
                    snapshots.append(await call.read())
                call.cancel()
        finally:
            await plane.stop(0.5)
    first = snapshots[0]
    assert isinstance(first, pb.WatchStargatesResponse)
    (entry,) = first.stargates
    fields = (entry.stargate_id, entry.advertise_addr, entry.http_advertise_addr, entry.grpc_pylon_dial_addr)
    assert fields == (
        "sg-1",
        f"127.0.0.1:{port}",
        "127.0.0.1:8000",
        "10.1.1.1:7",
    )
    assert list(first.watch_stargate_urls) == ["peer-a:50071", "http://peer-b:50071"]
    assert len(snapshots) == 3 and all(s == first for s in snapshots)


async def test_stop_ends_open_watch_streams_promptly() -> None:
    async with aiohttp.ClientSession() as session:
        plane = ControlPlane(RoutingState(), settings(watch_heartbeat_ms=60_000), session)
        port, _ = await plane.start("127.0.0.1:0", "127.0.0.1:0")
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = stargate_pb2_grpc.StargateControlPlaneStub(channel).WatchStargates(
                pb.WatchStargatesRequest(), timeout=CALL_TIMEOUT_S
            )
            assert isinstance(await call.read(), pb.WatchStargatesResponse)
            started = time.monotonic()
            await plane.stop(5.0)
            assert time.monotonic() - started < 2.0
            assert await call.read() is aio.EOF


def test_settings_errors_name_the_flag() -> None:
    for unusable in ("grpc://nohost", "ftp://127.0.0.1:5", "foo bar", "http://a b:5"):
        with pytest.raises(ConfigError, match="--remote-stargate-url"):
            ControlPlaneSettings("sg", "a:1", "b:2", remote_stargate_urls=(unusable,)).validate()
    with pytest.raises(ConfigError, match="--watch-heartbeat-ms"):
        ControlPlaneSettings("sg", "a:1", "b:2", watch_heartbeat_ms=0).validate()
    with pytest.raises(ConfigError, match="--registration-update-idle-timeout-ms"):
        ControlPlaneSettings("sg", "a:1", "b:2", idle_timeout_floor_ms=-1).validate()


async def test_bind_failure_names_the_flag() -> None:
    async with aiohttp.ClientSession() as session:
        first = ControlPlane(RoutingState(), settings(), session)
        port, _ = await first.start("127.0.0.1:0", "127.0.0.1:0")
        second = ControlPlane(RoutingState(), settings(), session)
        try:
            with pytest.raises(ConfigError, match="--listen-addr"):
                await second.start(f"127.0.0.1:{port}", "127.0.0.1:0")
        finally:
            await first.stop(0.1)


async def test_an_advertised_address_with_a_colon_in_its_host_names_the_flag() -> None:
    """Peers and Pylons would dial ``1.2.3.4:5`` as a name no resolver answers, for ever."""
    with pytest.raises(ConfigError, match="--advertise-addr"):
        async with running(advertise_addr="1.2.3.4:5:63571"):
            pass
