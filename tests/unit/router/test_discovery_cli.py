"""``--dns-nameserver``: an address the resolver can dial, else a usage error naming the flag."""

from __future__ import annotations

import argparse

import pytest

from stargate.errors import ConfigError
from stargate.router.discovery_cli import discovery_settings


def options(nameserver: str) -> argparse.Namespace:
    return argparse.Namespace(
        dns_nameserver=nameserver,
        disable_dns_discovery=True,
        stargate_discovery_dns_name=None,
        dns_poll_ms=5000,
        pod_name=None,
        pod_namespace=None,
        dns_allow_loopback_peers=False,
    )


@pytest.mark.parametrize("nameserver", ["10.0.0.10:53", "[fd00::a]:5353"])
def test_an_address_and_port_is_taken(nameserver: str) -> None:
    assert discovery_settings(options(nameserver)).nameserver == nameserver


@pytest.mark.parametrize("nameserver", ["localhost:53", "dns.example.com:53", "256.1.1.1:53", "10.0.0.10"])
def test_a_name_or_a_bad_address_is_a_usage_error(nameserver: str) -> None:
    with pytest.raises(ConfigError) as raised:
        discovery_settings(options(nameserver))
    assert raised.value.path == "--dns-nameserver" and nameserver in raised.value.message
