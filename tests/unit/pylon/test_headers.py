from __future__ import annotations

import pytest

from stargate.errors import RequestError
from stargate.pylon.headers import (
    RetryPolicy,
    dynamo_priority,
    parse_request_meta,
    response_headers,
    upstream_headers,
)

POLICY = RetryPolicy(frozenset({429, 503}), True, "x-stargate-upstream-retryable", True)
REQ = {"x-request-id": "r1", "x-model": "m", "x-input-tokens": "10"}


def test_b82_b83_dynamo_priority_headers() -> None:
    spoofed = [*REQ.items(), ("x-dynamo-request-priority", "42"), ("x-dynamo-request-strict-priority", "1")]
    out = upstream_headers(
        spoofed, retry_header="x-stargate-upstream-retryable", priority=7, dynamo_ceiling=3600
    )
    assert out.getall("x-dynamo-request-priority") == ["3593"]
    assert out.getall("x-dynamo-request-strict-priority") == ["0"]
    out = upstream_headers(REQ.items(), retry_header="x", priority=None, dynamo_ceiling=3600)
    assert out["x-dynamo-request-priority"] == "0"


def test_b84_passthrough_strips_priority_headers() -> None:
    inbound = [*REQ.items(), ("x-priority", "7"), ("x-dynamo-request-strict-priority", "1")]
    out = upstream_headers(inbound, retry_header="x", priority=7, dynamo_ceiling=None)
    assert "x-dynamo-request-priority" not in out and "x-dynamo-request-strict-priority" not in out
    assert out["x-priority"] == "7"


def test_b85_priority_ceiling() -> None:
    assert dynamo_priority(0, 3600) == 3600
    assert dynamo_priority(5000, 3600) == 0


def test_b86_expected_queue_header_stripped() -> None:
    inbound = [
        *REQ.items(),
        ("x-stargate-expected-queue-ms", "5"),
        ("Connection", "keep-alive"),
        ("Host", "h"),
    ]
    out = upstream_headers(inbound, retry_header="x", priority=None, dynamo_ceiling=None)
    assert "x-stargate-expected-queue-ms" not in out and "connection" not in out and "host" not in out
    assert out["x-request-id"] == "r1"


@pytest.mark.parametrize("missing", ["x-request-id", "x-model", "x-input-tokens"])
def test_b87_missing_required(missing: str) -> None:
    headers = {k: v for k, v in REQ.items() if k != missing}
    with pytest.raises(RequestError, match=f"missing required {missing} header"):
        parse_request_meta(headers)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-input-tokens", "abc"),
        ("x-input-tokens", ""),
        ("x-input-tokens", "  "),
        ("x-priority", "not-a-priority"),
    ],
)
def test_b88_invalid_headers(name: str, value: str) -> None:
    with pytest.raises(RequestError, match=f"invalid {name} header"):
        parse_request_meta({**REQ, name: value})


def test_b92_retryable_upstream_rejection() -> None:
    out, failure = response_headers(
        [("x-stargate-upstream-retryable", "TRUE"), ("Retry-After", "2"), ("content-length", "3")],
        429,
        POLICY,
    )
    assert failure is None
    assert (
        out["x-stargate-retryable"] == "true"
        and out["x-stargate-retry-reason"] == "upstream_admission_rejected"
    )
    assert out["x-stargate-retry-after-ms"] == "2000"
    assert "x-stargate-upstream-retryable" not in out and "content-length" not in out


def test_b93_spoofed_retry_headers_dropped() -> None:
    spoof = [
        ("x-stargate-retryable", "true"),
        ("x-stargate-retry-reason", "x"),
        ("x-stargate-retry-after-ms", "1"),
    ]
    out, failure = response_headers(spoof, 429, POLICY)
    assert failure == "missing_upstream_retry_header"
    assert not any(k.lower().startswith("x-stargate") for k in out)
    assert response_headers([], 500, POLICY)[1] == "upstream_nonretryable_status"
