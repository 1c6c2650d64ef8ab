"""Request header contract (§4.2) and forwarding filters (§4.3, §4.4)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import Target
from stargate.errors import RequestError
from stargate.router.headers import (
    REQUEST_DROPPED,
    RESPONSE_DROPPED,
    filter_headers,
    parse_request,
    valid_header_name,
)

PLAIN = AlgorithmDefinition(Algorithm.POWER_OF_N)
NEEDS_KEY = AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN, require_cache_affinity_key=True)
BASE = {"x-request-id": "r1", "x-input-tokens": "12", "x-model": "m"}


def resolve(model_id: str, requested: Algorithm | None) -> AlgorithmDefinition:
    if requested is None:
        return NEEDS_KEY if model_id == "keyed" else PLAIN
    if requested is Algorithm.ROUND_ROBIN:
        return AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    raise RequestError(f"routing method {requested} is not available")


def parse(extra: dict[str, str] | None = None, drop: tuple[str, ...] = (), limit: int = 1000):  # type: ignore[no-untyped-def]
    headers: CIMultiDict[str] = CIMultiDict({k: v for k, v in BASE.items() if k not in drop})
    headers.update(extra or {})
    return parse_request(
        headers,
        resolve=resolve,
        retry_budget_header="x-stargate-max-wait-ms",
        max_replay_body_bytes=limit,
        received_at=5.0,
    )


def status_of(extra: dict[str, str] | None = None, drop: tuple[str, ...] = (), limit: int = 1000) -> int:
    with pytest.raises(RequestError) as info:
        parse(extra, drop, limit)
    return info.value.status


def test_valid_request_parses_all_fields() -> None:
    req = parse(
        {
            "x-routing-key": " rk ",
            "x-priority": "+4",
            "x-max-wait-ms": "0250",
            "x-request-slo-ms": "900",
            "x-cache-affinity-key": "k1",
            "x-stargate-max-wait-ms": "77",
            "x-routing-method": " ROUND_ROBIN ",
        }
    )
    assert req.target == Target("rk", "m")
    assert (req.input_tokens, req.priority, req.max_wait_ms, req.request_slo_ms) == (12, 4, 250, 900)
    assert (req.cache_affinity_key, req.retry_budget_ms, req.requested_method) == ("k1", 77, "ROUND_ROBIN")
    assert req.definition.algorithm is Algorithm.ROUND_ROBIN
    assert req.received_at == 5.0


@pytest.mark.parametrize("missing", ["x-request-id", "x-input-tokens", "x-model"])
def test_p98_missing_required_header_is_400(missing: str) -> None:
    assert status_of(drop=(missing,)) == 400


def test_p98_blank_required_text_is_400() -> None:
    assert status_of({"x-request-id": "  "}) == 400
    assert status_of({"x-model": ""}) == 400


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-input-tokens", "bad"),
        ("x-max-wait-ms", "-1"),
        ("x-request-slo-ms", "1.5"),
        ("x-priority", "4294967296"),
        ("x-input-tokens", "18446744073709551616"),
        ("x-input-tokens", ""),
        ("x-priority", "1_0"),
        ("x-priority", "1 0"),
        ("x-stargate-max-wait-ms", "soon"),
    ],
)
def test_p99_invalid_numeric_header_is_400(name: str, value: str) -> None:
    assert status_of({name: value}) == 400


def test_numeric_edges_accepted() -> None:
    assert parse({"x-priority": "4294967295"}).priority == 2**32 - 1
    assert parse({"x-input-tokens": " 18446744073709551615 "}).input_tokens == 2**64 - 1


def test_p100_blank_routing_key_and_affinity_key_are_absent() -> None:
    req = parse({"x-routing-key": "  ", "x-cache-affinity-key": ""})
    assert req.target.routing_key is None and req.cache_affinity_key is None


def test_non_ascii_optional_text_is_absent() -> None:
    assert parse({"x-routing-key": "r\u00e9k"}).target.routing_key is None


@pytest.mark.parametrize("value", ["", "   ", "sticky", "caf\u00e9"])
def test_p10_blank_unknown_or_invalid_routing_method_is_400(value: str) -> None:
    assert status_of({"x-routing-method": value}) == 400


def test_max_wait_capped_at_60s_and_slo_zero_is_absent_p122() -> None:
    req = parse({"x-max-wait-ms": "999999", "x-request-slo-ms": "0"})
    assert req.max_wait_ms == 60_000 and req.request_slo_ms is None


def test_required_affinity_key_is_400() -> None:
    assert status_of({"x-model": "keyed"}) == 400
    assert parse({"x-model": "keyed", "x-cache-affinity-key": "k"}).cache_affinity_key == "k"


def test_p106_declared_body_over_limit_is_413_even_for_unknown_model() -> None:
    assert status_of({"content-length": "15", "x-model": "nobody-serves-this"}, limit=8) == 413
    assert parse({"content-length": "8"}, limit=8).input_tokens == 12


def test_validation_order_first_failure_wins() -> None:
    with pytest.raises(RequestError) as info:
        parse({"x-input-tokens": "bad", "content-length": "99"}, drop=("x-model",), limit=8)
    assert "x-input-tokens" in info.value.message
    with pytest.raises(RequestError) as info:
        parse({"x-priority": "bad", "x-routing-method": "sticky"})
    assert "x-routing-method" in info.value.message
    with pytest.raises(RequestError) as info:
        parse({"x-priority": "bad", "x-routing-method": "pulsar"})
    assert "x-priority" in info.value.message
    assert status_of({"x-stargate-max-wait-ms": "x", "content-length": "99"}, limit=8) == 400


def test_retry_budget_header_disabled_when_unset() -> None:
    headers: CIMultiDict[str] = CIMultiDict({**BASE, "x-stargate-max-wait-ms": "nope"})
    req = parse_request(
        headers, resolve=resolve, retry_budget_header=None, max_replay_body_bytes=10, received_at=0.0
    )
    assert req.retry_budget_ms is None


def test_p103_request_filter_drops_hop_by_hop_and_stargate_headers() -> None:
    items = [
        ("Connection", "keep-alive"),
        ("Host", "x"),
        ("x-routing-method", "random"),
        ("x-stargate-error-code", "e"),
        ("x-model", "m"),
        ("X-Custom", "1"),
        ("X-Custom", "2"),
        ("x-stargate-expected-queue-ms", "5"),
        ("TE", "trailers"),
        ("x-stargate-max-wait-ms", "9"),
    ]
    out = filter_headers(items, REQUEST_DROPPED)
    assert list(out.items()) == [
        ("x-model", "m"),
        ("X-Custom", "1"),
        ("X-Custom", "2"),
        ("x-stargate-max-wait-ms", "9"),
    ]


def test_p105_response_filter_strips_retry_metadata() -> None:
    items = [
        ("x-stargate-retryable", "true"),
        ("x-stargate-retry-reason", "r"),
        ("x-stargate-retry-after-ms", "1"),
        ("x-stargate-expected-queue-ms", "2"),
        ("x-stargate-error-code", "e"),
        ("x-upstream-header", "u"),
        ("Transfer-Encoding", "chunked"),
    ]
    assert list(filter_headers(items, RESPONSE_DROPPED).items()) == [("x-upstream-header", "u")]


def test_header_name_validation() -> None:
    assert valid_header_name("x-stargate-max-wait-ms")
    assert not valid_header_name("bad header") and not valid_header_name("")
