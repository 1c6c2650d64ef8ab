"""Pylon's registration side against a real gRPC fake Stargate (spec pylon.md §9, §14 items 110-113)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from test_pylon_support import FakeStargate

from stargate.proto import stargate_pb2
from stargate.pylon.registration import RegistrationClient, RouterInfo, StargateDiscovery, router_from_info


@pytest.fixture
async def stargate() -> AsyncIterator[FakeStargate]:
    s = await FakeStargate().start()
    yield s
    await s.close()


async def until(what: str, check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def dead_address() -> str:
    """A loopback port nothing listens on (bound briefly, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def client(retry_s: float) -> RegistrationClient:
    return RegistrationClient(
        snapshot=lambda: stargate_pb2.InferenceServerRegistration(inference_server_id="p1"),
        interval_ms=20,
        token=lambda: None,
        retry_s=retry_s,
    )


async def test_b110_refused_stream_retried_after_delay_and_ended_stream_reopened(
    stargate: FakeStargate,
) -> None:
    stargate.refuse_registrations = 2
    stargate.end_registrations = 1  # the first accepted stream ends after its first ack
    reg = client(retry_s=0.2)
    reg.update_routers({"sg-1": RouterInfo("sg-1", stargate.address, "http://" + stargate.address)})
    try:
        await until("a registration after two refusals", lambda: len(stargate.messages) >= 1)
        first, second, third = stargate.register_times[:3]
        assert second - first >= 0.19 and third - second >= 0.19  # retried after retry_s, not at once
        await until("the ended stream reopened", lambda: stargate.register_calls >= 4)
        assert stargate.register_times[3] - stargate.register_times[2] < 0.19  # reopened without the delay
        await until("messages on the reopened stream", lambda: len(stargate.messages) >= 3)
        assert stargate.register_calls == 4
    finally:
        await reg.close()


async def test_b111_watch_disconnect_drops_routers_then_rewatches(stargate: FakeStargate) -> None:
    stargate.end_watches = 1
    seen: list[set[str]] = []
    discovery = StargateDiscovery(
        [stargate.address], lambda routers: seen.append(set(routers)), retry_s=0.2, initial_timeout_s=5
    )
    task = asyncio.get_running_loop().create_task(discovery.run())
    try:
        await until("routers dropped and re-added", lambda: len(seen) >= 3)
        assert seen[:3] == [{"sg-1"}, set(), {"sg-1"}]
        assert stargate.watch_calls == 2
        assert stargate.watch_times[1] - stargate.watch_times[0] >= 0.19
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_b112_unanswered_extra_watch_url_waits_for_initial_timeout(stargate: FakeStargate) -> None:
    stargate.watch_urls = ["http://" + dead_address()]
    seen: list[set[str]] = []
    loop = asyncio.get_running_loop()
    discovery = StargateDiscovery(
        [stargate.address], lambda routers: seen.append(set(routers)), retry_s=0.05, initial_timeout_s=0.4
    )
    started = loop.time()
    task = loop.create_task(discovery.run())
    try:
        await until("the seed snapshot", lambda: stargate.watch_calls >= 1)
        await asyncio.sleep(0.2)
        assert seen == []  # the extra URL has not answered and the timeout has not expired
        await until("the first published router set", lambda: bool(seen))
        assert loop.time() - started >= 0.39
        assert seen == [{"sg-1"}]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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
