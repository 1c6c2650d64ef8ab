"""Pylon's registration side against a real gRPC fake Stargate (spec pylon.md §9, §14 items 110-113)."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import sys
from typing import Any

import pytest
from support.pylon_fakes import FakeStargate
from support.waiting import until

from stargate.proto import stargate_pb2, stargate_pb2_grpc
from stargate.pylon.registration import (
    RegistrationClient,
    RouterInfo,
    StargateDiscovery,
    open_channel,
    router_from_info,
)
from stargate.wire.clock import ManualClock


def dead_address() -> str:
    """A loopback port nothing listens on (bound briefly, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def registration() -> stargate_pb2.InferenceServerRegistration:
    return stargate_pb2.InferenceServerRegistration(inference_server_id="p1")


def client(retry_s: float, clock: ManualClock | None = None, **kwargs: Any) -> RegistrationClient:
    return RegistrationClient(
        snapshot=kwargs.pop("snapshot", registration),
        interval_ms=20,
        token=lambda: None,
        retry_s=retry_s,
        clock=clock,
        rng=random.Random(7),
        **kwargs,
    )


def route_to(stargate: FakeStargate) -> dict[str, RouterInfo]:
    return {"sg-1": RouterInfo("sg-1", stargate.address, "http://" + stargate.address)}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_b110_refused_stream_retried_after_delay_and_ended_stream_reopened(
    stargate: FakeStargate,
) -> None:
    stargate.refuse_registrations = 2
    stargate.end_registrations = 1  # the first accepted stream ends after its first ack
    clock = ManualClock()
    downs: list[bool] = []
    reg = client(retry_s=1.0, clock=clock, on_connected=lambda _r, up: downs.append(up))
    reg.update_routers(route_to(stargate))
    try:
        await until("the first refusal", lambda: downs == [False])
        await clock.sleeping(1)  # the backoff sleep
        clock.advance(0.99)
        assert clock.pending == 1 and stargate.register_calls == 1  # not retried before the 1 s interval
        clock.advance(0.26)  # 1 s plus at most 25 % jitter
        await until("the second refusal", lambda: downs == [False, False])
        await clock.sleeping(1)
        clock.advance(1.99)
        assert clock.pending == 1 and stargate.register_calls == 2  # the next retry backs off to 2 s
        clock.advance(0.51)
        await until("a registration after two refusals", lambda: len(stargate.messages) >= 1)
        await until("the ended stream reopened without a delay", lambda: stargate.register_calls >= 4)
        await until("messages on the reopened stream", lambda: len(stargate.messages) >= 2)
        assert stargate.register_calls == 4
    finally:
        await reg.close()


async def test_retries_back_off_to_at_most_5_s_however_long_the_outage(stargate: FakeStargate) -> None:
    """A router restarted after a long outage gets its Pylons back within its start window."""
    stargate.refuse_registrations = 8
    clock = ManualClock()
    downs: list[bool] = []
    reg = client(retry_s=1.0, clock=clock, on_connected=lambda _r, up: downs.append(up))
    reg.update_routers(route_to(stargate))
    try:
        for refused in range(1, 9):
            await until("a refusal", lambda refused=refused: len(downs) == refused)  # type: ignore[misc]
            clock.advance(5.0)
        await until("registered after eight refusals", lambda: len(stargate.messages) >= 1)
    finally:
        await reg.close()


async def test_a_heartbeat_that_cannot_be_built_is_logged_and_the_stream_reopened(
    stargate: FakeStargate, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    def snapshot() -> stargate_pb2.InferenceServerRegistration:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise ValueError("Value out of range")
        return stargate_pb2.InferenceServerRegistration(inference_server_id="p1")

    clock = ManualClock()
    events: list[bool] = []
    reg = client(retry_s=1.0, clock=clock, snapshot=snapshot, on_connected=lambda _r, up: events.append(up))
    reg.update_routers(route_to(stargate))
    try:
        await until("the first ack", lambda: events == [True])
        await clock.sleeping(1)  # the message generator waits for the next heartbeat
        clock.advance(0.02)  # which fails to build
        await until("the stream reported down", lambda: events == [True, False])
        lost = [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]
        assert lost and "ValueError: Value out of range" in lost[0] and stargate.address in lost[0]
        clock.advance(1.3)
        await until("the stream re-established", lambda: events == [True, False, True])
        assert stargate.register_calls == 2
    finally:
        await reg.close()
    assert events[-1] is False  # closing reports the stream down


async def test_an_unreachable_stargate_is_logged_once_and_reported_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = dead_address()
    clock = ManualClock()
    events: list[bool] = []
    reg = client(retry_s=1.0, clock=clock, on_connected=lambda _r, up: events.append(up))
    reg.update_routers({"sg-1": RouterInfo("sg-1", address, "http://" + address)})
    try:
        for attempt in range(1, 5):
            await until("a failed attempt", lambda attempt=attempt: len(events) == attempt)  # type: ignore[misc]
            clock.advance(60.0)
    finally:
        await reg.close()
    assert len(events) >= 4 and not any(events)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"with Stargate at http://{address} failed (UNAVAILABLE" in warnings[0]


async def test_a_stargate_dropped_from_discovery_is_reported_at_once() -> None:
    address = dead_address()
    clock = ManualClock()
    events: list[tuple[str, bool, list[str]]] = []

    def seen(router: str, up: bool) -> None:
        events.append((router, up, reg.routers))

    reg = client(retry_s=1.0, clock=clock, on_connected=seen)
    reg.update_routers({"sg-1": RouterInfo("sg-1", address, "http://" + address)})
    try:
        await until("a failed attempt", lambda: len(events) == 1)  # the stream now waits to retry
        reg.update_routers({})
        assert events == [("sg-1", False, ["sg-1"]), ("sg-1", False, [])]
    finally:
        await reg.close()


async def test_b111_a_watch_that_ends_keeps_its_routers_until_another_answers(stargate: FakeStargate) -> None:
    """A watch through a Service moves to another replica when its own goes away: the registrations
    with the replicas that stay must not end meanwhile."""
    stargate.end_watches = 1
    seen: list[set[str]] = []
    clock = ManualClock()
    discovery = StargateDiscovery(
        [stargate.address], lambda routers: seen.append(set(routers)), retry_s=1.0, initial_timeout_s=0.5,
        clock=clock, rng=random.Random(7),
    )  # fmt: skip
    task = asyncio.get_running_loop().create_task(discovery.run())
    try:
        await until("the first router set", lambda: seen == [{stargate.address}])
        await clock.sleeping(2)  # the initial-discovery timeout and the watch's retry delay
        clock.advance(0.5)  # the initial-discovery timeout expires while no URL answers
        await settle()
        clock.advance(0.49)
        await settle()
        assert clock.pending == 1 and stargate.watch_calls == 1  # not re-watched before the 1 s retry
        assert seen == [{stargate.address}]
        clock.advance(0.26)  # 1 s plus at most 25 % jitter
        await until("re-watched", lambda: stargate.watch_calls == 2)
        await settle()
        assert seen == [{stargate.address}]  # never emptied, nothing new to publish
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_replicas_listing_each_other_are_one_router_each_and_outlive_a_seed(
    stargate: FakeStargate,
) -> None:
    """A replica lists itself under its id and its peers under their addresses: each router is
    registered with once, and the one a lost seed's peer still lists keeps its registration."""
    other = await FakeStargate().start()
    stargate.peers, other.peers = [other.address], [stargate.address]
    seen: list[set[str]] = []
    clock = ManualClock()
    discovery = StargateDiscovery(
        [stargate.address, other.address], lambda routers: seen.append(set(routers)), retry_s=1.0,
        initial_timeout_s=60, clock=clock, rng=random.Random(7),
    )  # fmt: skip
    task = asyncio.get_running_loop().create_task(discovery.run())
    try:
        await until("the first router set", lambda: bool(seen))
        assert seen == [{stargate.address, other.address}]
        await stargate.close()
        await clock.sleeping(2)  # the initial-discovery timeout and the lost watch's retry delay
        await settle()
        assert seen == [{stargate.address, other.address}]  # the other replica still lists both
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await other.close()


async def test_b112_unanswered_extra_watch_url_waits_for_initial_timeout(stargate: FakeStargate) -> None:
    stargate.watch_urls = ["http://" + dead_address()]
    seen: list[set[str]] = []
    clock = ManualClock()
    discovery = StargateDiscovery(
        [stargate.address], lambda routers: seen.append(set(routers)), retry_s=10.0, initial_timeout_s=5.0,
        clock=clock, rng=random.Random(7),
    )  # fmt: skip
    task = asyncio.get_running_loop().create_task(discovery.run())
    try:
        # The seed's snapshot named the extra URL, whose watch failed and waits to retry.
        await clock.sleeping(2)
        assert stargate.watch_calls == 1
        clock.advance(4.99)
        await settle()
        assert seen == []  # the extra URL has not answered and the timeout has not expired
        clock.advance(0.01)
        await until("the first published router set", lambda: bool(seen))
        assert seen == [{stargate.address}]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_stream_whose_acks_stop_is_reopened(stargate: FakeStargate) -> None:
    """A connection gone silent without a FIN or a reset (a lost NAT entry) left Pylon waiting on
    its stream for ever, out of routing once Stargate's idle timeout passed."""
    stargate.silent_registrations = 1
    reg = client(retry_s=0.05, ack_timeout_s=0.3)
    reg.update_routers(route_to(stargate))
    try:
        await until("a second stream", lambda: stargate.register_calls >= 2)
        messages = len(stargate.messages)
        await until("the second stream acked", lambda: len(stargate.messages) > messages + 2)
        assert stargate.register_calls == 2  # acked: kept
    finally:
        await reg.close()


async def test_a_discovery_watch_that_sends_nothing_is_reopened(stargate: FakeStargate) -> None:
    """Stargate sends its snapshot every --watch-heartbeat-ms; a watch on a connection gone silent
    waited for ever, and Pylon missed every Stargate added since."""
    discovery = StargateDiscovery([stargate.address], lambda _routers: None, retry_s=0.05, silence_s=0.3)
    task = asyncio.get_running_loop().create_task(discovery.run())
    try:
        await until("a second watch", lambda: stargate.watch_calls >= 2)  # the fake sends one snapshot
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class SilencingProxy:
    """Forwards TCP to ``port``; ``silence()`` stops forwarding on the connections open then (no FIN,
    no reset: a lost NAT entry) while new ones pass."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.silenced: set[asyncio.StreamWriter] = set()
        self.open: set[asyncio.StreamWriter] = set()
        self.accepted = 0

    async def start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def silence(self) -> None:
        self.silenced |= self.open

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.open.add(writer)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while (data := await src.read(65536)) and writer not in self.silenced:
                dst.write(data)
            if writer in self.silenced:
                await asyncio.Event().wait()  # held open, silent, until the test's server closes
            dst.close()

        try:
            await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        finally:
            writer.close()
            up_writer.close()


async def test_a_stream_on_a_connection_gone_silent_is_reopened_on_a_new_one(stargate: FakeStargate) -> None:
    """The stream reopened after its acks stopped took, through gRPC's process-wide pool of
    connections, the very connection that had gone silent."""
    proxy = SilencingProxy(int(stargate.address.rsplit(":", 1)[1]))
    server = await proxy.start()
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    # The discovery watch keeps a channel to the same address open, as a Pylon does.
    watch = open_channel("http://" + address)
    watching = stargate_pb2_grpc.StargateControlPlaneStub(watch).WatchStargates(  # type: ignore[no-untyped-call]
        stargate_pb2.WatchStargatesRequest()
    )
    reg = client(retry_s=0.05, ack_timeout_s=0.3)
    reg.update_routers({"sg-1": RouterInfo("sg-1", address, "http://" + address)})
    try:
        await watching.read()
        await until("a first stream", lambda: len(stargate.messages) >= 2)
        proxy.silence()
        await until("a stream on a new connection", lambda: stargate.register_calls >= 2)
        messages = len(stargate.messages)
        await until("messages on it", lambda: len(stargate.messages) > messages + 2)
        assert proxy.accepted >= 2
    finally:
        await reg.close()
        watching.cancel()
        await watch.close()
        server.close()


async def test_b113_dials_the_dial_address_with_advertise_authority(stargate: FakeStargate) -> None:
    """The stream reaches the server at the dial address even though the authority names another host."""
    router = router_from_info(
        stargate_pb2.StargateInfo(
            stargate_id="sg-1", advertise_addr="stargate.invalid:1", grpc_pylon_dial_addr=stargate.address
        )
    )
    assert router is not None
    reg = client(retry_s=0.05)
    reg.update_routers({router.router_id: router})
    try:
        await until("a registration through the dial address", lambda: len(stargate.messages) >= 1)
    finally:
        await reg.close()


TLS_FRONT = """
import asyncio, os, sys, tempfile
import trustme

ca = trustme.CA()
roots = os.path.join(tempfile.mkdtemp(), "ca.pem")
ca.cert_pem.write_to_path(roots)
os.environ["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = roots  # read once, at the first TLS channel
import grpc
from stargate.pylon.registration import open_channel
from stargate.proto import stargate_pb2, stargate_pb2_grpc


class Front(stargate_pb2_grpc.StargateControlPlaneServicer):
    async def WatchStargates(self, request, context):
        yield stargate_pb2.WatchStargatesResponse()


async def main() -> None:
    cert = ca.issue_cert("localhost")
    key_pem, chain_pem = cert.private_key_pem.bytes(), b"".join(b.bytes() for b in cert.cert_chain_pems)
    server = grpc.aio.server()
    stargate_pb2_grpc.add_StargateControlPlaneServicer_to_server(Front(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, chain_pem)]))
    await server.start()
    channel = open_channel(f"https://localhost:{port}", authority="stargate.internal:50071")
    try:
        call = stargate_pb2_grpc.StargateControlPlaneStub(channel).WatchStargates(
            stargate_pb2.WatchStargatesRequest(), timeout=10
        )
        await call.read()
        print("reached")
    except grpc.aio.AioRpcError as exc:
        print(exc.code().name, exc.details())
    finally:
        await channel.close()
        await server.stop(0)


asyncio.run(main())
"""


async def test_a_tls_dial_address_is_checked_against_the_host_dialled() -> None:
    """Behind a TLS front whose certificate names the front, every registration failed with
    "Hostname Verification Check failed": gRPC checked the certificate against the advertised
    address presented as the authority (docs/compat.md)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TLS_FRONT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert out.decode().split() == ["reached"], (out + err).decode()
