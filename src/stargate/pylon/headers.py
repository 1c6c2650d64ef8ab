"""Header contracts of the relay: required request headers (§7 step 2), upstream request headers
and priority mapping (§8.4), response headers and retry metadata (§8.5).
"""

from __future__ import annotations

import email.utils
import functools
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from multidict import CIMultiDict

from stargate.errors import RequestError
from stargate.wire import headers as h
from stargate.wire.headers import (
    HOP_BY_HOP,
    IDENTITY,
    InvalidNumber,
    forwardable,
    nominated_names,
    optional_unsigned,
    parse_unsigned,
    text_value,
    without_names,
)
from stargate.wire.limits import I31_MAX, U32_MAX, U64_MAX, sat_u64

RETRY_CONTROL = frozenset({h.UPSTREAM_RETRYABLE, h.RETRYABLE, h.RETRY_REASON, h.RETRY_AFTER_MS})
_REQUEST_DROP = (
    HOP_BY_HOP
    | RETRY_CONTROL
    | IDENTITY
    | {"host", "content-length", h.TUNNEL_METHOD, h.TUNNEL_PATH, h.EXPECTED_QUEUE_MS}
    | {h.DYNAMO_PRIORITY, h.DYNAMO_STRICT_PRIORITY}
)
_RESPONSE_DROP = HOP_BY_HOP | RETRY_CONTROL | {"content-length"}



@dataclass(frozen=True, slots=True)
class RequestMeta:
    request_id: str
    model: str
    input_tokens: int
    priority: int | None
    routing_key: str | None


def _number(headers: Mapping[str, str], name: str, limit: int) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        return parse_unsigned(raw, limit)
    except InvalidNumber:
        raise RequestError(f"invalid {name} header") from None


def parse_request_meta(headers: Mapping[str, str]) -> RequestMeta:
    """Required headers (§7 step 2) with the shared rules of ``stargate.wire.headers``."""
    request_id = text_value(headers.get(h.REQUEST_ID))
    if request_id is None:
        raise RequestError(f"missing required {h.REQUEST_ID} header")
    model = text_value(headers.get(h.MODEL))
    if model is None:
        raise RequestError(f"missing required {h.MODEL} header")
    tokens = _number(headers, h.INPUT_TOKENS, U64_MAX)
    if tokens is None:
        raise RequestError(f"missing required {h.INPUT_TOKENS} header")
    priority = _number(headers, h.PRIORITY, U32_MAX)
    return RequestMeta(request_id, model, tokens, priority, text_value(headers.get(h.ROUTING_KEY)))


def dynamo_priority(priority: int | None, ceiling: int) -> int:
    """``C - min(p, C)`` with ``C = min(ceiling, 2^31-1)``; absent priority is the lowest (0)."""
    c = min(ceiling, I31_MAX)
    rank = c if priority is None else min(priority, c)
    return c - rank


@functools.lru_cache(maxsize=8)
def _request_drop(retry_header: str) -> frozenset[str]:
    return _REQUEST_DROP | {retry_header}


def upstream_headers(
    headers: Iterable[tuple[str, str]], *, retry_header: str, priority: int | None, dynamo_ceiling: int | None
) -> CIMultiDict[str]:
    """Filtered request headers for the engine; ``dynamo_ceiling`` None = no priority headers."""
    out = forwardable(headers, _request_drop(retry_header))
    if dynamo_ceiling is not None:
        out[h.DYNAMO_PRIORITY] = str(dynamo_priority(priority, dynamo_ceiling))
        out[h.DYNAMO_STRICT_PRIORITY] = "0"
    return out


def retry_after_ms(value: str | None, now_s: float | None = None) -> int | None:
    """``Retry-After`` as milliseconds: delta seconds, or time until an HTTP-date (0 if past)."""
    if value is None:
        return None
    seconds = optional_unsigned(value, U64_MAX)
    if seconds is not None:
        return sat_u64(seconds * 1000)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    now = time.time() if now_s is None else now_s
    return max(0, int((when.timestamp() - now) * 1000))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    statuses: frozenset[int]
    require_header: bool
    header: str
    propagate_retry_after: bool


def response_headers(
    upstream: Iterable[tuple[str, str]], status: int, policy: RetryPolicy
) -> tuple[CIMultiDict[str], str | None]:
    """Relayed headers plus retry metadata; second value = non-retryable failure reason, if any.

    One pass over ``upstream``; Connection-nominated names are taken out afterwards (rarely any).
    """
    out: CIMultiDict[str] = CIMultiDict()
    authorized = False
    retry_after: str | None = None
    connection: list[str] = []
    for name, value in upstream:
        lowered = name.lower()
        if lowered == "connection":
            connection.append(value)
        if lowered == policy.header:
            authorized = value.strip().lower() == "true"
            continue
        if lowered in _RESPONSE_DROP:
            continue
        if lowered == "retry-after":
            retry_after = value
        out.add(name, value)
    if connection:
        nominated = nominated_names(connection)
        out = without_names(out, nominated)
        if "retry-after" in nominated:
            retry_after = None
    if 200 <= status < 300:
        return out, None
    if status in policy.statuses and (authorized or not policy.require_header):
        out[h.RETRYABLE] = "true"
        out[h.RETRY_REASON] = "upstream_admission_rejected"
        ms = retry_after_ms(retry_after) if policy.propagate_retry_after else None
        if ms is not None:
            out[h.RETRY_AFTER_MS] = str(ms)
        return out, None
    return out, (
        "missing_upstream_retry_header" if status in policy.statuses else "upstream_nonretryable_status"
    )
