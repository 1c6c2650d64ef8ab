"""Fuzzed header values and stats: the shared parser returns a bounded value or raises its one error,
Stargate and Pylon accept and reject exactly the same values, and a heartbeat is always buildable."""

from __future__ import annotations

import math
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from stargate.balancer.config import LbConfig
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import ModelStats
from stargate.errors import RequestError
from stargate.pylon.headers import parse_request_meta
from stargate.router.headers import MAX_WAIT_CAP_MS, parse_request
from stargate.wire import headers as h
from stargate.wire.limits import U32_MAX, U64_MAX
from stargate.wire.proto import stats_from_proto, stats_to_proto

# The spec's numeric rule (stargate.md §4.2) written independently of the parser: trimmed ASCII
# digits with an optional leading '+'.
SPEC_NUMBER = re.compile(r"[ \t]*\+?([0-9]+)[ \t]*")

NUMBER_LIKE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.from_regex(r"\A[ \t]{0,2}[+-]?[0-9]{0,30}[ \t]{0,2}\Z"),
    st.integers(min_value=19, max_value=6000).map(lambda n: "9" * n),
    st.integers(min_value=0, max_value=6000).map(lambda n: "0" * n + "1"),
    st.sampled_from(["+", "", " ", "1e3", "0x10", "1_000", "٣", "١٢", "5\x0b", "NaN", "inf", "+-1", "1 2"]),
)
LATIN1 = st.binary(max_size=20).map(lambda b: b.decode("latin-1"))
ANY_VALUE = st.one_of(NUMBER_LIKE, st.text(max_size=40), LATIN1)


def spec_number(raw: str, limit: int) -> int | None:
    match = SPEC_NUMBER.fullmatch(raw) if raw.isascii() else None
    if match is None:
        return None
    value = int(match.group(1).lstrip("0")[:100] or "0")
    return value if value <= limit else None


@given(raw=ANY_VALUE, limit=st.sampled_from([U32_MAX, U64_MAX]))
def test_parse_unsigned_is_the_spec_rule_and_raises_only_invalid_number(raw: str, limit: int) -> None:
    expected = spec_number(raw, limit)
    try:
        value = h.parse_unsigned(raw, limit)
    except h.InvalidNumber:
        assert expected is None
    else:
        assert value == expected and 0 <= value <= limit


@settings(max_examples=50)
@given(raw=st.one_of(st.none(), ANY_VALUE))
def test_text_value_is_trimmed_visible_ascii_or_absent(raw: str | None) -> None:
    value = h.text_value(raw)
    assert value is None or (value == value.strip(" \t") != "" and h.is_visible_ascii(value))


PLAIN = AlgorithmDefinition(Algorithm.POWER_OF_N)
SHARED = (h.REQUEST_ID, h.MODEL, h.INPUT_TOKENS, h.PRIORITY, h.ROUTING_KEY)
"""Headers both Stargate (§4.2) and Pylon (§7 step 2) parse."""


def resolve(model_id: str, requested: Algorithm | None) -> AlgorithmDefinition:
    return PLAIN


def router_outcome(headers: CIMultiDict[str]) -> tuple[object, ...]:
    try:
        req = parse_request(
            headers, resolve=resolve, retry_budget_header=None, max_replay_body_bytes=1 << 26, received_at=0.0
        )
    except RequestError as exc:
        return ("rejected", exc.status)
    return ("accepted", req.request_id, req.target.model_id, req.input_tokens, req.priority,
            req.target.routing_key)  # fmt: skip


def pylon_outcome(headers: CIMultiDict[str]) -> tuple[object, ...]:
    try:
        meta = parse_request_meta(headers)
    except RequestError as exc:
        return ("rejected", exc.status)
    return ("accepted", meta.request_id, meta.model, meta.input_tokens, meta.priority or 0, meta.routing_key)


VALID = {h.REQUEST_ID: st.just("r1"), h.MODEL: st.just("m"), h.INPUT_TOKENS: st.just("5"),
         h.PRIORITY: st.just("3"), h.ROUTING_KEY: st.just("k")}  # fmt: skip


@st.composite
def shared_headers(draw: st.DrawFn) -> CIMultiDict[str]:
    """Each shared header absent, valid, or fuzzed; the values both sides see are identical."""
    headers: CIMultiDict[str] = CIMultiDict()
    for name in SHARED:
        kind = draw(st.sampled_from(["valid", "valid", "fuzzed", "absent"]))
        if kind != "absent":
            headers[name] = draw(VALID[name] if kind == "valid" else ANY_VALUE)
    return headers


@given(headers=shared_headers())
def test_stargate_and_pylon_accept_and_reject_the_same_values(headers: CIMultiDict[str]) -> None:
    router, pylon = router_outcome(headers), pylon_outcome(headers)
    assert router == pylon
    assert router[0] == "accepted" or router[1] == 400


U = st.integers(min_value=-(2**70), max_value=2**70)
F = st.floats(allow_nan=True, allow_infinity=True)


@settings(max_examples=50)
@given(
    ints=st.lists(U, min_size=13, max_size=13),
    floats=st.lists(F, min_size=3, max_size=3),
    by_priority=st.dictionaries(U, U, max_size=4),
)
def test_any_stats_build_a_heartbeat_and_read_back_in_range(
    ints: list[int], floats: list[float], by_priority: dict[int, int]
) -> None:
    stats = ModelStats(
        last_mean_input_tps=floats[0], output_tps=floats[1], max_output_tps=floats[2],
        queue_size=ints[0], queued_input_size=ints[1], kv_cache_capacity_tokens=ints[2],
        kv_cache_used_tokens=ints[3], kv_cache_free_tokens=ints[4], num_running_queries=ints[5],
        max_engine_concurrency=ints[6], total_query_input_size=ints[7], input_processing_queries=ints[8],
        output_generation_queries=ints[9], stats_observed_at_unix_ms=ints[10],
        queue_time_estimate_ms_by_priority=by_priority,
    )  # fmt: skip
    back = stats_from_proto(stats_to_proto(stats))
    assert 0 <= back.queue_size <= U64_MAX and 0 <= back.total_query_input_size <= U64_MAX
    by_priority_back = back.queue_time_estimate_ms_by_priority.items()
    assert all(0 <= p <= U32_MAX and 0 <= v <= U64_MAX for p, v in by_priority_back)
    assert math.isnan(back.last_mean_input_tps) or back.last_mean_input_tps == floats[0]


ROUTER_HEADERS = (*SHARED, h.MAX_WAIT_MS, h.REQUEST_SLO_MS, h.CACHE_AFFINITY_KEY, h.ROUTING_METHOD,
                  h.RETRY_BUDGET_MS, "content-length")  # fmt: skip
METHODS = st.sampled_from(["round-robin", "pulsar", " Power_Of_N "])
ROUTER_VALID = {**VALID, h.MAX_WAIT_MS: st.just("250"), h.REQUEST_SLO_MS: st.just("900"),
                h.CACHE_AFFINITY_KEY: st.just("k"), h.RETRY_BUDGET_MS: st.just("77"),
                "content-length": st.just("10"), h.ROUTING_METHOD: METHODS}  # fmt: skip


@st.composite
def router_headers(draw: st.DrawFn) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name in ROUTER_HEADERS:
        kind = draw(st.sampled_from(["valid", "valid", "fuzzed", "absent"]))
        if kind != "absent":
            headers[name] = draw(ROUTER_VALID[name] if kind == "valid" else ANY_VALUE)
    return headers


@given(headers=router_headers())
def test_every_router_header_parses_to_bounded_values_or_a_400_or_413(headers: CIMultiDict[str]) -> None:
    try:
        req = parse_request(headers, resolve=LbConfig.permissive().resolve_algorithm,
                            retry_budget_header=h.RETRY_BUDGET_MS, max_replay_body_bytes=100, received_at=0.0)
    except RequestError as exc:  # PayloadTooLarge is one
        assert exc.status in (400, 413)
        return
    assert 0 <= req.input_tokens <= U64_MAX and 0 <= req.priority <= U32_MAX
    assert req.max_wait_ms is None or 0 <= req.max_wait_ms <= MAX_WAIT_CAP_MS
    assert req.request_slo_ms is None or 0 < req.request_slo_ms <= U64_MAX
    assert req.retry_budget_ms is None or 0 <= req.retry_budget_ms <= U64_MAX
    for text in (req.request_id, req.target.model_id, req.target.routing_key, req.cache_affinity_key):
        assert text is None or (h.is_visible_ascii(text) and text == text.strip(" \t") != "")
