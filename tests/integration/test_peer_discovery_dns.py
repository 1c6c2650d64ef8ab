"""Peer discovery (spec §5.7) against a real DNS server: A/AAAA, SRV, loopback filter, failures."""

from __future__ import annotations

import pytest
from support.dns import Zone, dns_server

from stargate.router.discovery import DiscoveryFailed, DiscoverySettings, PeerDiscovery

NAME = "stargate-headless.ns.svc.cluster.local"


def discovery(nameserver: str, **overrides: object) -> PeerDiscovery:
    values: dict[str, object] = {"dns_name": NAME, "nameserver": nameserver, "timeout_s": 2.0}
    values.update(overrides)
    return PeerDiscovery(DiscoverySettings(**values), grpc_port=50071)  # type: ignore[arg-type]


async def test_a_and_aaaa_records_become_peers_on_the_grpc_port_without_loopback() -> None:
    zone = Zone(addresses={NAME: ["10.0.0.7", "127.0.0.5", "0.0.0.0", "fd00::7", "::1"]})
    with dns_server(zone) as nameserver:
        peers = await discovery(nameserver).peers()
    assert [(p.stargate_id, p.advertise_addr) for p in peers] == [
        ("10.0.0.7:50071", "10.0.0.7:50071"),
        ("[fd00::7]:50071", "[fd00::7]:50071"),
    ]
    assert all(p.http_advertise_addr == "" for p in peers)


async def test_loopback_peers_are_admitted_only_by_the_test_switch() -> None:
    zone = Zone(addresses={NAME: ["127.0.0.2", "127.0.0.3"]})
    with dns_server(zone) as nameserver:
        assert await discovery(nameserver).peers() == []
        peers = await discovery(nameserver, allow_loopback=True).peers()
    assert [p.advertise_addr for p in peers] == ["127.0.0.2:50071", "127.0.0.3:50071"]


async def test_srv_mode_with_pod_identity_uses_each_targets_addresses_and_the_record_port() -> None:
    zone = Zone(
        addresses={"sg-a.example": ["10.0.0.1"], "sg-b.example": ["10.0.0.2"], NAME: ["10.9.9.9"]},
        srv={f"_grpc._tcp.{NAME}": [("sg-a.example", 7001), ("sg-b.example", 7002)]},
    )
    with dns_server(zone) as nameserver:
        peers = await discovery(nameserver, pod_name="sg-a", pod_namespace="ns").peers()
    assert sorted(p.advertise_addr for p in peers) == ["10.0.0.1:7001", "10.0.0.2:7002"]
    assert f"SRV _grpc._tcp.{NAME}" in zone.queries
    assert f"A {NAME}" not in zone.queries


@pytest.mark.parametrize("zone", [Zone(failing=True), Zone()], ids=["servfail", "nxdomain"])
async def test_dns_failures_raise_discovery_failed(zone: Zone) -> None:
    with dns_server(zone) as nameserver, pytest.raises(DiscoveryFailed, match=NAME):
        await discovery(nameserver).peers()


async def test_disabled_discovery_asks_no_dns_server() -> None:
    zone = Zone(addresses={NAME: ["10.0.0.7"]})
    with dns_server(zone) as nameserver:
        assert await discovery(nameserver, dns_name=None).peers() == []
    assert zone.queries == []
