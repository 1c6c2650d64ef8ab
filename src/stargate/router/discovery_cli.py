"""The ``stargate`` flags of peer discovery (spec §7.4) and their translation to settings."""

from __future__ import annotations

import argparse
import ipaddress
from typing import Any, Protocol

from stargate.errors import ConfigError
from stargate.router.discovery import DiscoverySettings
from stargate.wire.address import split_host_port


class AddFlag(Protocol):
    def __call__(self, flag: str, *, env_var: str | None = None, **kw: Any) -> None: ...


def add_discovery_flags(add: AddFlag) -> None:
    add("--pod-name", env_var="POD_NAME", default=None, help="with --pod-namespace: SRV peer lookup")
    add("--pod-namespace", env_var="POD_NAMESPACE", default=None, help="with --pod-name: SRV peer lookup")
    add(
        "--dns-nameserver",
        default=None,
        metavar="IP:PORT",
        help="DNS server for peer discovery; unset = the system resolver",
    )
    # Peers on loopback are ignored (spec §5.7); tests run replicas on 127.0.0.x.
    add("--dns-allow-loopback-peers", action="store_true", help=argparse.SUPPRESS)


def discovery_settings(options: argparse.Namespace) -> DiscoverySettings:
    nameserver = (options.dns_nameserver or "").strip() or None
    if nameserver is not None:
        try:
            host, port = split_host_port(nameserver)
            ipaddress.ip_address(host)  # the resolver dials an address: a name would need a DNS server
        except ValueError:
            port = 0
        if port == 0:
            raise ConfigError(
                f"expected an IP address and port (IP:PORT), got {nameserver!r}", path="--dns-nameserver"
            )
    name = None if options.disable_dns_discovery else (options.stargate_discovery_dns_name or "").strip()
    return DiscoverySettings(
        dns_name=name or None,
        poll_ms=options.dns_poll_ms,
        pod_name=(options.pod_name or "").strip() or None,
        pod_namespace=(options.pod_namespace or "").strip() or None,
        nameserver=nameserver,
        allow_loopback=options.dns_allow_loopback_peers,
    )
