"""Peer discovery for `WatchStargates` (spec §5.7): which other Stargate replicas exist.

Three modes: disabled (self only); with a pod name and namespace, the headless Service's SRV
records ``_grpc._tcp.<name>`` (each target's addresses, the record's port); otherwise the A/AAAA
records of the name (this Stargate's gRPC port). Peers get ``stargate_id = advertise_addr``;
loopback and unspecified addresses are ignored (``allow_loopback`` admits them, for tests that run
replicas on 127.0.0.x). Any DNS failure yields no peers, so the snapshot falls back to self only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.rdtypes.IN.SRV
import dns.resolver

from stargate.errors import DiscoveryFailed
from stargate.router.watch import StargateEntry
from stargate.wire.address import join_host_port, split_host_port

log = logging.getLogger(__name__)
MAX_PEERS = 256
ADDRESS_TYPES = ("A", "AAAA")


@dataclass(frozen=True)
class DiscoverySettings:
    dns_name: str | None = None
    """``None`` disables discovery (``--disable-dns-discovery``)."""
    poll_ms: int = 1000
    pod_name: str | None = None
    pod_namespace: str | None = None
    nameserver: str | None = None
    """``HOST:PORT`` of the DNS server to ask; ``None`` = the system's resolver configuration."""
    allow_loopback: bool = False
    timeout_s: float = 2.0

    @property
    def srv_mode(self) -> bool:
        return bool((self.pod_name or "").strip() and (self.pod_namespace or "").strip())


def make_resolver(settings: DiscoverySettings) -> dns.asyncresolver.Resolver:
    if settings.nameserver:
        host, port = split_host_port(settings.nameserver.strip())
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.lifetime = settings.timeout_s
    resolver.cache = None
    return resolver


class PeerDiscovery:
    """One ``peers()`` call is one poll; it raises ``DiscoveryFailed`` instead of DNS errors."""

    def __init__(
        self, settings: DiscoverySettings, grpc_port: int, resolver: dns.asyncresolver.Resolver | None = None
    ) -> None:
        self._settings = settings
        self._grpc_port = grpc_port
        self._resolver = resolver or make_resolver(settings)

    @property
    def enabled(self) -> bool:
        return bool((self._settings.dns_name or "").strip())

    async def peers(self) -> list[StargateEntry]:
        if not self.enabled:
            return []
        name = (self._settings.dns_name or "").strip()
        try:
            if self._settings.srv_mode:
                found = await self._srv_peers(f"_grpc._tcp.{name}")
            else:
                found = [(ip, self._grpc_port) for ip in await self._addresses(name)]
        except (dns.exception.DNSException, OSError) as exc:
            raise DiscoveryFailed(f"{name}: {exc}") from exc
        entries: list[StargateEntry] = []
        for ip, port in found:
            if self._admissible(ip):
                addr = join_host_port(ip, port)
                entries.append(StargateEntry(stargate_id=addr, advertise_addr=addr))
        return entries[:MAX_PEERS]

    def _admissible(self, ip: str) -> bool:
        try:
            parsed = ipaddress.ip_address(ip)
        except ValueError:
            return False
        return self._settings.allow_loopback or not (parsed.is_loopback or parsed.is_unspecified)

    async def _addresses(self, name: str) -> list[str]:
        """A and AAAA answers; a type without records is empty, any other error propagates."""
        results = await asyncio.gather(*(self._lookup(name, kind) for kind in ADDRESS_TYPES))
        return [ip for ips in results for ip in ips]

    async def _lookup(self, name: str, kind: str) -> list[str]:
        try:
            answer = await self._resolver.resolve(name, kind, search=False)
        except dns.resolver.NoAnswer:
            return []
        return [rdata.to_text() for rdata in answer]

    async def _srv_peers(self, name: str) -> list[tuple[str, int]]:
        answer = await self._resolver.resolve(name, "SRV", search=False)
        targets: list[tuple[str, int]] = []
        for rdata in answer:
            assert isinstance(rdata, dns.rdtypes.IN.SRV.SRV)
            targets.append((rdata.target.to_text(omit_final_dot=True), int(rdata.port)))
        addresses = await asyncio.gather(*(self._addresses(target) for target, _ in targets[:MAX_PEERS]))
        return [(ip, port) for (_, port), ips in zip(targets, addresses, strict=False) for ip in ips]


def with_self(self_entry: StargateEntry, peers: Iterable[StargateEntry]) -> list[StargateEntry]:
    """Peers first, self last: grouping by address then keeps this Stargate's own id for its
    address when DNS also lists it."""
    return [*peers, self_entry]
