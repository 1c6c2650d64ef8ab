"""Active health checks eject a backend that stops answering, and bring it back (real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from grpc import aio
from support.loopback import serving
from support.waiting import until

from stargate.balancer.types import Target
from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc
from stargate.router import control_plane
from stargate.router import state as routing_state
from stargate.router.control_plane import ControlPlane, ControlPlaneSettings
from stargate.router.health import HealthProber, HealthSettings, LoopLag
from stargate.router.state import SERVER_ERRORS_IN_A_ROW, RoutingState

T = Target(None, "model-a")
FAST = HealthSettings(interval_s=0.0, timeout_s=0.05, recheck_s=0.0, unhealthy_threshold=2)


@dataclass
class StandIn:
    """A backend's /health that answers, or hangs (a frozen Pylon) until released."""

    hanging: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        if self.hanging:
            await asyncio.wait_for(self.release.wait(), 10)
        return web.Response(text="ok")


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    backend = StandIn()
    app = web.Application()
    app.router.add_get("/health", backend.handle)
    async with serving(app) as backend.url:
        yield backend
        backend.release.set()


def recording_prober(
    session: aiohttp.ClientSession, url: str, events: list[tuple[str, int]], **kwargs: Any
) -> HealthProber:
    """A fast prober of ``url`` that appends its ejections and restorations to ``events``."""
    return HealthProber(
        session,
        url,
        "b1",
        settings=FAST,
        on_eject=lambda n: events.append(("eject", n)),
        on_restore=lambda rtt: events.append(("restore", rtt)),
        **kwargs,
    )


async def test_consecutive_failures_eject_and_one_success_restores(stand_in: StandIn) -> None:
    events: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as session:
        prober = recording_prober(session, stand_in.url, events)
        assert await prober.probe() is not None
        stand_in.hanging = True
        assert await prober.probe() is None and events == []  # one failure is not enough
        assert await prober.probe() is None and events == [("eject", 2)]
        assert prober.last_error == "no answer within 0.05 s"
        assert await prober.probe() is None and events == [("eject", 2)]  # ejected once
        stand_in.hanging = False
        rtt = await prober.probe()
        assert rtt is not None and events == [("eject", 2), ("restore", rtt)]
        assert (prober.failures, prober.ejected) == (0, False)


async def test_late_probes_of_a_backend_that_answers_requests_do_not_eject_it(stand_in: StandIn) -> None:
    answering = True
    events: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as session:
        prober = recording_prober(
            session, stand_in.url, events, answering=lambda seconds: answering and 0.0 < seconds < 1.0
        )
        rtt = await prober.probe()
        assert rtt is not None
        stand_in.hanging = True
        for _ in range(3):  # busy, not down: the RTT stays and nothing is counted
            assert await prober.probe() == rtt
        assert (prober.failures, prober.late, prober.ejected, events) == (0, True, False, [])
        answering = False  # it stopped answering requests too
        assert await prober.probe() is None and await prober.probe() is None
        assert events == [("eject", 2)]


async def test_probes_that_time_out_while_the_router_runs_late_do_not_eject(stand_in: StandIn) -> None:
    router_late = True
    events: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as session:
        prober = recording_prober(session, stand_in.url, events, loop_late=lambda _seconds: router_late)
        rtt = await prober.probe()
        assert rtt is not None
        stand_in.hanging = True
        for _ in range(3):  # timed out, but the router was the late one
            assert await prober.probe() == rtt
        assert (prober.failures, prober.late, events) == (0, True, [])
        router_late = False
        assert await prober.probe() is None and await prober.probe() is None
        assert events == [("eject", 2)]


async def test_a_refused_probe_counts_even_while_the_router_runs_late() -> None:
    events: list[tuple[str, int]] = []
    async with aiohttp.ClientSession() as session:
        with socket.socket() as unused:  # a port nothing listens on
            unused.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{unused.getsockname()[1]}"
        prober = recording_prober(session, url, events, loop_late=lambda _seconds: True)
        assert await prober.probe() is None and await prober.probe() is None
        assert (prober.late, events) == (False, [("eject", 2)])
        assert "Cannot connect to host 127.0.0.1" in prober.last_error


async def test_loop_lag_tells_a_late_wake_up_and_one_still_waiting() -> None:
    now = [0.0]
    wakes = iter([0.05, 0.05, 0.35])  # on time, on time, 300 ms late (woken at 0.45 s)
    seen: list[bool] = []

    async def sleep(_seconds: float) -> None:
        step = next(wakes, None)
        if step is None:  # the loop is busy and this wake-up still waits, 200 ms past its tick
            now[0] += 0.25
            seen.append(lag.late_within(0.01))
            raise asyncio.CancelledError
        now[0] += step
        seen.append(lag.late_within(0.5))

    lag = LoopLag(0.1, tick_s=0.05, clock=lambda: now[0], sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        await lag.run()
    assert seen == [False, False, True, True]  # late from the moment its wake-up is overdue
    assert lag.late_within(0.3) and not lag.late_within(0.2)  # the late wake-up, 0.25 s ago


async def test_probe_loop_rechecks_sooner_after_a_failure(stand_in: StandIn) -> None:
    sleeps: list[float] = []
    settings = HealthSettings(interval_s=1.0, timeout_s=0.05, recheck_s=0.2, unhealthy_threshold=3)

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 4:
            stand_in.hanging = False
        if len(sleeps) > 5:
            await asyncio.Event().wait()  # park the loop; stop() cancels it
        await asyncio.sleep(0)

    stand_in.hanging = True
    async with aiohttp.ClientSession() as session:
        prober = HealthProber(session, stand_in.url, "b1", settings=settings, sleep=sleep)
        prober.start()
        await until("six probe-loop sleeps", lambda: len(sleeps) > 5)
        task = prober.stop()
        assert task is not None
        await asyncio.gather(task, return_exceptions=True)
    # failures: probe 1, 2, 3 fail (hanging), probe 4 succeeds, then the healthy interval again
    assert sleeps[:6] == [1.0, 0.2, 0.2, 0.2, 1.0, 1.0]


async def test_a_prober_stops_even_when_its_cancel_does_not_land(stand_in: StandIn) -> None:
    """aiohttp turns a cancel that lands as a probe's timeout fires into that timeout: the loop
    probed a departed backend for ever, and its router never exited on SIGTERM."""
    parked = asyncio.Event()

    async def wait_that_swallows_a_cancel(_seconds: float) -> None:
        parked.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # until cancelled; the cancel then goes unseen

    async with aiohttp.ClientSession() as session:
        prober = HealthProber(session, stand_in.url, "b1", settings=FAST, sleep=wait_that_swallows_a_cancel)
        prober.start()
        await asyncio.wait_for(parked.wait(), 2.0)
        task = prober.stop()
        assert task is not None
        await asyncio.wait_for(asyncio.shield(task), 2.0)  # without the stop flag: probes, parks again
        assert task.done()


@dataclass
class Plane:
    state: RoutingState
    stub: stargate_pb2_grpc.StargateControlPlaneStub


@contextlib.asynccontextmanager
async def start_plane(health: HealthSettings) -> AsyncIterator[Plane]:
    settings = ControlPlaneSettings(
        stargate_id="sg-1", advertise_addr="127.0.0.1:0", http_advertise_addr="127.0.0.1:8000", health=health
    )
    state = RoutingState()
    async with aiohttp.ClientSession() as session:
        plane = ControlPlane(state, settings, session)
        try:
            grpc_port, _ = await plane.start("127.0.0.1:0", "127.0.0.1:0")
            async with aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                yield Plane(state, stargate_pb2_grpc.StargateControlPlaneStub(channel))
        finally:
            await plane.stop(0.5)


async def register(
    plane: Plane, url: str, backend_id: str = "b1", models: tuple[str, ...] = ("model-a",)
) -> aio.StreamStreamCall:
    call = plane.stub.RegisterInferenceServer(timeout=30)
    message = pb.InferenceServerRegistration(inference_server_id=backend_id, inference_server_url=url)
    for model_id in models:
        entry = message.models[model_id]
        entry.status = pb.INFERENCE_SERVER_STATUS_ACTIVE  # type: ignore[assignment]
        entry.stats.last_mean_input_tps = 100.0
    await call.write(message)
    await call.read()
    return call


async def until_routable(state: RoutingState, routable: bool, timeout_s: float = 10.0) -> float:
    """Seconds until the target's routability is ``routable``."""
    what = "routable" if routable else "out of routing"
    return await until(what, lambda: (state.view(T) is not None) == routable, timeout_s=timeout_s)


async def test_a_hung_backend_leaves_routing_without_a_heartbeat_and_returns(stand_in: StandIn) -> None:
    async with start_plane(FAST) as plane:
        call = await register(plane, stand_in.url)
        assert plane.state.view(T) is not None
        stand_in.hanging = True
        await until_routable(plane.state, False)
        assert plane.state.is_registered("b1") and plane.state.is_advertised(T)  # 503, not 404
        stand_in.hanging = False
        stand_in.release.set()
        await until_routable(plane.state, True)
        call.cancel()


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
async def test_a_frozen_backend_process_leaves_routing_within_3_s_with_the_defaults() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", HEALTH_SERVER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        port = int(await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 10))
        async with start_plane(HealthSettings()) as plane:
            call = await register(plane, f"http://127.0.0.1:{port}")
            assert plane.state.view(T) is not None
            os.kill(process.pid, signal.SIGSTOP)
            left_after = await until_routable(plane.state, False, timeout_s=10)
            os.kill(process.pid, signal.SIGCONT)
            await until_routable(plane.state, True)
            call.cancel()
        assert left_after <= 3.0
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(5)
        if process.stdout is not None:
            process.stdout.close()


async def test_server_errors_hold_a_backend_out_for_one_model_and_it_returns_without_an_update(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its other model stays in routing, also one nobody else serves; the held one comes back when
    the hold ends, whatever the backend's heartbeat period."""
    monkeypatch.setattr(routing_state, "SERVER_ERROR_HOLD_S", 0.3)
    monkeypatch.setattr(control_plane, "SERVER_ERROR_HOLD_S", 0.3)
    only_b1 = Target(None, "model-b")
    async with start_plane(FAST) as plane:
        first = await register(plane, stand_in.url, "b1", ("model-a", "model-b"))
        second = await register(plane, stand_in.url, "b2")
        for _ in range(SERVER_ERRORS_IN_A_ROW):
            plane.state.server_error(plane.state.reserve(T, "b1", 10, 0))
        view = plane.state.view(T)
        assert view is not None and [c.cluster_id for c in view.candidates] == ["b2"]
        assert plane.state.view(only_b1) is not None
        await until("model-a back on b1", lambda: len(getattr(plane.state.view(T), "candidates", ())) == 2)
        first.cancel()
        second.cancel()
    logged = [r.getMessage() for r in caplog.records if r.name == "stargate.router.control_plane"]
    assert any("b1 out of routing for model model-a for 0.3 s" in line for line in logged)
    assert any("b1 back in routing for model model-a" in line for line in logged)
