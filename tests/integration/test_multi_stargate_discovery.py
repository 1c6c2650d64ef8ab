"""Three Stargates found through a real DNS server, one Pylon registered with all of them (spec
stargate.md §5.7, pylon.md §9.1), all as processes: the Stargates on 127.0.0.2-4 share one gRPC
port, their A records are changed while they run, and the Pylon, seeded with the first only,
follows each change within a discovery poll.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from grpc import aio
from support.dns import Zone, dns_server
from support.waiting import until

from stargate.bench.fleet import (
    StargateAddrs,
    command,
    parse_engine_ready,
    parse_pylon_ready,
    parse_stargate_ready,
)
from stargate.bench.procs import ManagedProcess, stop_all
from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc

NAME = "stargates.test"
MODEL = "llama"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
POLL_MS = 100
READY_TIMEOUT_S = 20.0
DEADLINE_S = 8.0
T = TypeVar("T")


def shared_free_port() -> int:
    """A TCP port free on every replica address (each Stargate listens on HOST:port)."""
    for _ in range(20):
        with socket.socket() as first:
            first.bind((HOSTS[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in HOSTS[1:]:
                    with socket.socket() as other:
                        other.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on all replica addresses")


@dataclass
class Fleet:
    zone: Zone
    port: int
    stargates: dict[str, StargateAddrs]
    procs: list[ManagedProcess[Any]]
    http: aiohttp.ClientSession

    async def models(self, host: str) -> list[str]:
        async with self.http.get(f"http://{self.stargates[host].http}/v1/models") as resp:
            assert resp.status == 200
            return list((await resp.json())["model_ids"])

    async def until(self, what: str, check: Callable[[], Awaitable[bool]]) -> float:
        """Seconds until ``check()`` holds; fails with the process logs after the deadline."""

        async def alive_and_check() -> bool:
            for proc in self.procs:
                assert proc.returncode is None, f"{proc.name} exited\n{proc.log_tail()}"
            return await check()

        tails = lambda: "\n".join(p.log_tail(20) for p in self.procs)  # noqa: E731
        return await until(what, alive_and_check, timeout_s=DEADLINE_S, interval_s=0.02, details=tails)

    async def registered_on(self) -> set[str]:
        return {h for h in HOSTS if MODEL in await self.models(h)}


def _stargate(
    index: int, host: str, port: int, nameserver: str, log_dir: Path
) -> ManagedProcess[StargateAddrs]:
    argv = [*command("stargate"), "--stargate-id", f"sg-{index}", "--listen-addr", f"{host}:{port}",
            "--advertise-addr", f"{host}:{port}", "--model-discovery-listen-addr", f"{host}:0",
            "--http-listen-addr", f"{host}:0", "--metrics-host", host, "--metrics-port", "0",
            "--stargate-discovery-dns-name", NAME, "--dns-nameserver", nameserver,
            "--dns-allow-loopback-peers", "--dns-poll-ms", str(POLL_MS)]  # fmt: skip
    return ManagedProcess(f"stargate-{index}", argv, log_dir, parse_stargate_ready)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    zone = Zone(addresses={NAME: list(HOSTS)})
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[T]) -> T:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    with dns_server(zone) as nameserver:
        try:
            port = shared_free_port()
            engine_argv = [*command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0",
                           "--model-name", MODEL]  # fmt: skip
            engine, *stargates = await asyncio.gather(
                launch(ManagedProcess("engine", engine_argv, tmp_path, parse_engine_ready)),
                *(launch(_stargate(i, h, port, nameserver, tmp_path)) for i, h in enumerate(HOSTS)),
            )
            pylon_argv = [*command("pylon"), "--upstream-http-base-url", engine,
                          "--stargate-address", f"{HOSTS[0]}:{port}", "--http-listen-addr", "127.0.0.1:0",
                          "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--model-name", MODEL,
                          "--initial-input-tps", "1000", "--min-update-interval-ms", "100"]  # fmt: skip
            await launch(ManagedProcess("pylon", pylon_argv, tmp_path, parse_pylon_ready))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                yield Fleet(zone, port, dict(zip(HOSTS, stargates, strict=True)), procs, http)
        finally:
            await stop_all(procs, grace_s=3.0)


async def watch_once(target: str) -> pb.WatchStargatesResponse:
    async with aio.insecure_channel(target) as channel:
        call = stargate_pb2_grpc.StargateControlPlaneStub(channel).WatchStargates(
            pb.WatchStargatesRequest(), timeout=10.0
        )
        first = await call.read()
        call.cancel()
    assert isinstance(first, pb.WatchStargatesResponse)
    return first


async def test_pylon_registers_with_every_discovered_stargate_and_follows_dns_changes(fleet: Fleet) -> None:
    everywhere = set(HOSTS)
    await fleet.until("registration on all three", lambda: _equals(fleet.registered_on(), everywhere))

    seen = await watch_once(f"{HOSTS[1]}:{fleet.port}")
    ids = [(s.stargate_id, s.advertise_addr) for s in seen.stargates]
    p = fleet.port
    assert ids == [(f"127.0.0.2:{p}", f"127.0.0.2:{p}"), (f"127.0.0.4:{p}", f"127.0.0.4:{p}"),
                   ("sg-1", f"127.0.0.3:{p}")]  # fmt: skip

    fleet.zone.set_addresses(NAME, list(HOSTS[:2]))
    two = set(HOSTS[:2])
    removed = await fleet.until("deregistration from .4", lambda: _equals(fleet.registered_on(), two))
    fleet.zone.set_addresses(NAME, list(HOSTS))
    added = await fleet.until("registration on .4 again", lambda: _equals(fleet.registered_on(), everywhere))
    assert max(removed, added) < 3.0, (removed, added)

    fleet.zone.failing = True  # the seed Stargate falls back to itself only
    await fleet.until("fallback to the seed only", lambda: _equals(fleet.registered_on(), {HOSTS[0]}))
    fleet.zone.failing = False
    await fleet.until("recovery after DNS failure", lambda: _equals(fleet.registered_on(), everywhere))


async def test_a_replica_going_away_leaves_the_others_registrations_alone(fleet: Fleet) -> None:
    """The seed's watch ends with it (as a Service's does with the replica behind it): the Pylon
    keeps its registrations with the replicas still up, at every moment."""
    everywhere = set(HOSTS)
    await fleet.until("registration on all three", lambda: _equals(fleet.registered_on(), everywhere))
    fleet.zone.set_addresses(NAME, list(HOSTS[1:]))
    seed = next(proc for proc in fleet.procs if proc.name == "stargate-0")
    await seed.stop()
    loop = asyncio.get_running_loop()
    end = loop.time() + 2.5  # past the watch's 1 s retry and a DNS poll
    while loop.time() < end:
        for host in HOSTS[1:]:
            assert MODEL in await fleet.models(host), f"{host} lost the Pylon\n{fleet.procs[-1].log_tail(20)}"
        await asyncio.sleep(0.02)


async def _equals(got: Awaitable[set[str]], want: set[str]) -> bool:
    return await got == want
