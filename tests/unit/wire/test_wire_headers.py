"""One numeric rule for Stargate and Pylon; hop-by-hop and Connection-nominated headers dropped."""

from __future__ import annotations

import pytest

from stargate.errors import RequestError
from stargate.pylon.headers import parse_request_meta, upstream_headers
from stargate.router.headers import REQUEST_DROPPED, RESPONSE_DROPPED, filter_headers, parse_unsigned
from stargate.wire.headers import InvalidNumber, connection_nominated, forwardable
from stargate.wire.headers import parse_unsigned as wire_parse
from stargate.wire.limits import U32_MAX, U64_MAX

PYLON_REQ = {"x-request-id": "r1", "x-model": "m"}


def pylon_tokens(raw: str) -> int:
    return parse_request_meta({**PYLON_REQ, "x-input-tokens": raw}).input_tokens


def router_tokens(raw: str) -> int:
    return parse_unsigned("x-input-tokens", raw, U64_MAX)


@pytest.mark.parametrize(
    ("raw", "value"),
    [("5", 5), ("+5", 5), (" 7\t", 7), ("007", 7), ("0" * 5000 + "9", 9), (str(U64_MAX), U64_MAX), ("0", 0)],
)
def test_accepted_by_router_and_pylon_alike(raw: str, value: int) -> None:
    assert router_tokens(raw) == pylon_tokens(raw) == value


@pytest.mark.parametrize(
    "raw",
    ["", " ", "+", "-1", "1_000", "1 2", "0x10", "abc", "٣", "5\x0b", str(U64_MAX + 1), "9" * 4301],
)
def test_rejected_by_router_and_pylon_alike(raw: str) -> None:
    with pytest.raises(RequestError) as router_error:
        router_tokens(raw)
    with pytest.raises(RequestError) as pylon_error:
        pylon_tokens(raw)
    assert router_error.value.status == pylon_error.value.status == 400


def test_absurdly_long_digit_strings_never_reach_int() -> None:
    with pytest.raises(InvalidNumber, match="out of range"):
        wire_parse("1" * 1_000_000, U64_MAX)
    assert wire_parse(str(U32_MAX), U32_MAX) == U32_MAX
    with pytest.raises(InvalidNumber):
        wire_parse(str(U32_MAX + 1), U32_MAX)


def test_pylon_priority_uses_the_same_rule() -> None:
    meta = parse_request_meta({**PYLON_REQ, "x-input-tokens": "1", "x-priority": "+7"})
    assert meta.priority == 7
    with pytest.raises(RequestError, match="invalid x-priority header"):
        parse_request_meta({**PYLON_REQ, "x-input-tokens": "1", "x-priority": "9" * 5000})


def test_connection_nominated_names_are_dropped_both_ways() -> None:
    items = [
        ("Connection", "keep-alive, X-Hop-Secret"),
        ("connection", " x-other ,"),
        ("x-hop-secret", "s"),
        ("X-Other", "o"),
        ("x-model", "m"),
    ]
    assert connection_nominated(items) == {"keep-alive", "x-hop-secret", "x-other"}
    assert list(forwardable(items, frozenset()).items()) == [("x-model", "m")]
    assert list(filter_headers(items, REQUEST_DROPPED).items()) == [("x-model", "m")]
    assert list(filter_headers(items, RESPONSE_DROPPED).items()) == [("x-model", "m")]
    pylon = upstream_headers(items, retry_header="x", priority=None, dynamo_ceiling=None)
    assert list(pylon.items()) == [("x-model", "m")]


def test_identity_headers_from_clients_are_never_forwarded() -> None:
    items = [
        ("x-inference-server-id", "spoof"),
        ("X-Inference-Server-Url", "http://evil"),
        ("x-stargate-cluster-id", "c"),
        ("x-model", "m"),
    ]
    assert list(filter_headers(items, REQUEST_DROPPED).items()) == [("x-model", "m")]
    pylon = upstream_headers(items, retry_header="x", priority=None, dynamo_ceiling=None)
    assert list(pylon.items()) == [("x-model", "m")]
