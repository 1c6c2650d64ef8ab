from __future__ import annotations

import pytest

from stargate.wire.address import dial_url, join_host_port, split_host_port, split_ip_port


def test_split_keeps_names_and_unbrackets_ipv6() -> None:
    assert split_host_port("pod.svc:50071") == ("pod.svc", 50071)
    assert split_host_port("[::1]:0") == ("::1", 0)
    assert join_host_port("::1", 8000) == "[::1]:8000"
    assert join_host_port("10.0.0.1", 80) == "10.0.0.1:80"


@pytest.mark.parametrize(
    "bad",
    [
        "host",
        ":80",
        "host:",
        "host:65536",
        "host:8o",
        "host:٣",
        "1.2.3.4:5:6",
        "::1:80",
        "[]:80",
        "[::1:80",
        "a]:80",
    ],
)
def test_split_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        split_host_port(bad)


def test_listener_address_must_be_an_ip() -> None:
    assert split_ip_port("0.0.0.0:1") == ("0.0.0.0", 1)
    with pytest.raises(ValueError):
        split_ip_port("localhost:1")


def test_a_dial_url_keeps_its_form_with_its_scheme_lower_cased() -> None:
    assert dial_url(" pod.svc:50071 ") == "pod.svc:50071"
    assert dial_url("HTTPS://[::1]:443/") == "https://[::1]:443/"


@pytest.mark.parametrize(
    "bad", ["::1:50071", "[::1]:99999", "host:0", "quic://host:1", "http://user@host:1", "http://h:1?x"]
)
def test_a_dial_url_no_channel_can_dial_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        dial_url(bad)
