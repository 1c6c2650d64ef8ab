"""Registration streams against a real grpc.aio server and a real /health endpoint on loopback.

Conformance 81, 83, 85, 97, 128-131, 134, 136 (and §5.3 authentication, caps and shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from support.control_plane import (
    CALL_TIMEOUT_S,
    Harness,
    T,
    make_harness,
    message,
    rejected,
    send,
)

from stargate.balancer.types import Target
from stargate.proto import stargate_pb2 as pb
from stargate.router.health import HealthProber, HealthSettings, wait_stopped
from stargate.wire.clock import ManualClock


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with make_harness() as value:
        yield value


async def test_81_136_status_changes_drive_routing_and_acks_are_empty(harness: Harness) -> None:
    call = harness.open()
    ack = await send(call, message(harness.health.url))
    assert (ack.reverse_tunnel_target, ack.reverse_tunnel_pylon_dial_addr) == ("", "")
    view = harness.state.view(T)
    assert view is not None
    (candidate,) = view.candidates
    assert (candidate.cluster_id, candidate.stats.queue_size) == ("srv-1", 2)
    assert candidate.rtt_s > 0
    backend = view.pick_backend("srv-1")
    assert backend is not None and backend.url == harness.health.url
    await send(call, message(harness.health.url, status=pb.INFERENCE_SERVER_STATUS_INACTIVE))
    assert harness.state.view(T) is None and harness.state.is_advertised(T)
    await send(call, message(harness.health.url))
    assert harness.state.view(T) is not None
    await call.done_writing()
    assert await call.read() is aio.EOF


async def test_health_probe_sends_the_contract_headers(harness: Harness) -> None:
    call = harness.open()
    await send(call, message(harness.health.url))
    probe = harness.health.seen[0]
    assert probe["x-request-id"] == "stargate-health-srv-1"
    assert probe["x-model"] == "stargate-health"
    assert probe["x-input-tokens"] == "0"
    call.cancel()


async def test_83_failing_health_makes_backend_unroutable_until_recovery(harness: Harness) -> None:
    harness.health.healthy = False
    call = harness.open()
    await send(call, message(harness.health.url))
    assert harness.state.view(T) is None
    assert harness.state.is_advertised(T)
    harness.health.healthy = True
    await send(call, message(harness.health.url))
    assert harness.state.view(T) is not None
    call.cancel()


async def test_prober_status_follows_each_probe(harness: Harness) -> None:
    slow = HealthSettings(timeout_s=2.0)
    prober = HealthProber(harness.session, harness.health.url + "/", "x", settings=slow)
    assert await prober.probe() is not None
    assert prober.rtt_ns is not None
    harness.health.healthy = False
    assert await prober.rtt_for_update() == prober.rtt_ns
    assert await prober.probe() is None
    unreachable = HealthProber(harness.session, "http://127.0.0.1:1", "y", settings=slow)
    assert await unreachable.rtt_for_update() is None


async def test_background_loop_updates_status_until_stopped(harness: Harness) -> None:
    settings = HealthSettings(interval_s=0.0, recheck_s=0.0, timeout_s=2.0)
    prober = HealthProber(harness.session, harness.health.url, "loop", settings=settings)
    harness.health.healthy = False
    prober.rtt_ns = 1
    prober.start()
    async with asyncio.timeout(CALL_TIMEOUT_S):
        while prober.rtt_ns is not None:
            harness.health.probed.clear()
            await harness.health.probed.wait()
            await asyncio.sleep(0)
        harness.health.healthy = True
        while prober.rtt_ns is None:
            harness.health.probed.clear()
            await harness.health.probed.wait()
            await asyncio.sleep(0)
    task = prober.stop()
    assert task is not None and prober.stop() is None
    await wait_stopped([task])
    assert task.cancelled()


async def test_85_stream_close_removes_routes_and_id(harness: Harness) -> None:
    call = harness.open()
    await send(call, message(harness.health.url))
    await call.done_writing()
    assert await call.read() is aio.EOF
    assert harness.state.view(T) is None
    assert not harness.state.is_advertised(T)
    assert not harness.state.is_registered("srv-1")


async def test_a_backend_registering_and_leaving_is_logged_with_its_address(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stargate.router.control_plane")
    call = harness.open()
    await send(call, message(harness.health.url))
    await call.done_writing()
    assert await call.read() is aio.EOF
    lines = [r.getMessage() for r in caplog.records if r.name == "stargate.router.control_plane"]
    assert lines == [
        f"backend srv-1 registered at {harness.health.url} (cluster srv-1)",
        f"backend srv-1 at {harness.health.url} left routing: its registration stream ended",
    ]


async def test_97_duplicate_id_gets_already_exists_and_first_keeps_routing(harness: Harness) -> None:
    first = harness.open()
    await send(first, message(harness.health.url))
    error = await rejected(harness.open(), message(harness.health.url))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error.details() == "inference_server_id 'srv-1' is already registered"
    assert harness.state.view(T) is not None
    await send(first, message(harness.health.url))
    first.cancel()


@pytest.mark.parametrize(
    ("registration", "details"),
    [
        (pb.InferenceServerRegistration(inference_server_url="http://x:1"), "inference_server_id is empty"),
        (pb.InferenceServerRegistration(inference_server_id="a"), "inference_server_url is empty"),
        (
            pb.InferenceServerRegistration(inference_server_id="a", inference_server_url="quic://10.0.0.1:8080"),
            "invalid inference_server_url: inference_server_url scheme must be http or https",
        ),
        (
            pb.InferenceServerRegistration(
                inference_server_id="a", inference_server_url="http://backend.svc:8080", reverse_tunnel=True
            ),
            "reverse tunnel flag set but no reverse tunnel config",
        ),
    ],
)
async def test_128_129_130_admission_errors(
    harness: Harness, registration: pb.InferenceServerRegistration, details: str
) -> None:
    error = await rejected(harness.open(), registration)
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
    assert harness.state.registration_count() == 0


async def test_131_identity_change_ends_stream_and_removes_registration(harness: Harness) -> None:
    call = harness.open()
    await send(call, message(harness.health.url))
    error = await rejected(call, message(harness.health.url, cluster_id="other-cluster"))
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "cluster_id changed")
    assert harness.state.view(T) is None
    assert not harness.state.is_registered("srv-1")


async def test_authentication_routing_key_and_rejection(harness: Harness) -> None:
    call = harness.open(metadata=(("authorization", "Bearer team"),))
    await send(call, message(harness.health.url))
    assert harness.state.view(Target("rk-team", "model-a")) is not None
    assert harness.state.view(T) is None
    call.cancel()
    bad = harness.open(metadata=(("authorization", "Bearer bad"),))
    with pytest.raises(aio.AioRpcError) as info:
        await bad.read()  # rejected before its first message: writing one would race the status
    error = info.value
    assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, "authentication failed")


async def test_134_idle_timeout_closes_registration_and_frees_id() -> None:
    clock = ManualClock()
    async with make_harness(clock, idle_timeout_floor_ms=1000, idle_timeout_cap_ms=1000) as harness:
        call = harness.open(metadata=(("x-stargate-registration-heartbeat-ms", "not-a-number"),))
        await send(call, message(harness.health.url))
        await clock.sleeping(2)  # the stream waits for the next update (and discovery for its poll)
        clock.advance(0.999)
        await send(call, message(harness.health.url))  # not idle yet: the update is applied
        await clock.sleeping(2)
        clock.advance(1.0)
        with pytest.raises(aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert info.value.details() == "no registration update within 1 s"
        assert not harness.state.is_registered("srv-1")
        assert harness.state.view(T) is None
        again = harness.open()
        await send(again, message(harness.health.url))
        again.cancel()


async def test_an_update_sent_while_the_router_was_stopped_past_the_idle_timeout_keeps_it() -> None:
    """A router stopped longer than the idle timeout (SIGSTOP, a paused VM) finds on resume the
    timer fired and the Pylon's heartbeats still to be read: it reads them instead of dropping the
    registration (every request then answered 404 until the Pylons registered again)."""
    clock = ManualClock()
    async with make_harness(clock, idle_timeout_floor_ms=1000, idle_timeout_cap_ms=1000) as harness:
        call = harness.open()
        await send(call, message(harness.health.url))
        await clock.sleeping(2)
        clock.advance(5.0)  # far past the deadline: the router did not run meanwhile
        await send(call, message(harness.health.url))  # the heartbeat sent during the stop
        assert harness.state.is_registered("srv-1")
        call.cancel()


async def test_a_registration_out_of_routing_is_replaced_by_a_new_one_of_its_id() -> None:
    """A Pylon restarted under the same id while its old process hangs (a pod rescheduled off a
    stuck node): the old registration is out of routing, so the new one takes the id at once
    instead of ``ALREADY_EXISTS`` until the old stream's idle timeout."""
    probing = HealthSettings(interval_s=0.0, recheck_s=0.0, timeout_s=2.0)
    async with make_harness(health=probing) as harness:
        old = harness.open()
        await send(old, message(harness.health.url))
        error = await rejected(harness.open(), message(harness.health.url))
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS  # in routing: the first keeps its id
        harness.health.healthy = False
        async with asyncio.timeout(CALL_TIMEOUT_S):
            while harness.state.view(T) is not None:  # its health probes take it out
                harness.health.probed.clear()
                await harness.health.probed.wait()
        new = harness.open()  # (same health URL, still failing: registered, not yet routable)
        await send(new, message(harness.health.url))
        with pytest.raises(aio.AioRpcError) as info:
            await old.read()
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.ABORTED,
            "replaced by a new registration of the same inference_server_id",
        )
        assert harness.state.is_registered("srv-1")
        new.cancel()


async def test_caps_on_models_and_registrations() -> None:
    async with make_harness(max_registrations=1, max_models_per_registration=2) as harness:
        error = await rejected(harness.open(), message(harness.health.url, models=("a", "b", "c")))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == "too many models in one registration: 3 (limit 2)"
        assert harness.state.registration_count() == 0
        first = harness.open()
        await send(first, message(harness.health.url))
        error = await rejected(harness.open(), message(harness.health.url, server_id="srv-2"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "too many registrations (limit 1)"
        first.cancel()


async def test_a_model_id_no_request_can_name_ends_the_stream(harness: Harness) -> None:
    call = harness.open()
    await send(call, message(harness.health.url))
    error = await rejected(call, message(harness.health.url, models=("model-a", "R" * 256_000)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "model id is longer than 512 characters"
    assert harness.state.registration_count() == 0 and not harness.state.is_advertised(T)
    error = await rejected(harness.open(), message(harness.health.url, models=(" model-a",)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "model id must be visible ASCII without surrounding spaces"


async def test_shutdown_ends_streams_and_cleans_up(harness: Harness) -> None:
    call = harness.open()
    await send(call, message(harness.health.url))
    await harness.plane.stop(5.0)
    with pytest.raises(aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "stargate is shutting down"
    assert harness.state.registration_count() == 0
    assert harness.state.view(T) is None
