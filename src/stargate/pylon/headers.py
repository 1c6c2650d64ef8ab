"""Header contracts of the relay: required request headers (§7 step 2), upstream request headers
and priority mapping (§8.4), response headers and retry metadata (§8.5).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from multidict import CIMultiDict

from stargate.errors import RequestError

HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
)
RETRY_CONTROL = frozenset(
    {
        "x-stargate-upstream-retryable",
        "x-stargate-retryable",
        "x-stargate-retry-reason",
        "x-stargate-retry-after-ms",
    }
)
DYNAMO_PRIORITY = "x-dynamo-request-priority"
DYNAMO_STRICT = "x-dynamo-request-strict-priority"
_REQUEST_DROP = (
    HOP_BY_HOP
    | RETRY_CONTROL
    | {
        "host",
        "x-method",
        "x-path",
        "x-stargate-expected-queue-ms",
        DYNAMO_PRIORITY,
        DYNAMO_STRICT,
        "content-length",
    }
)
_RESPONSE_DROP = HOP_BY_HOP | RETRY_CONTROL | {"content-length"}
PRIORITY_MAX = 2**31 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1



@dataclass(frozen=True, slots=True)
class RequestMeta:
    request_id: str
    model: str
    input_tokens: int
    priority: int | None
    routing_key: str | None


def _ascii_trimmed(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return value if value and value.isascii() else None


def parse_request_meta(headers: Mapping[str, str]) -> RequestMeta:
    request_id = _ascii_trimmed(headers.get("x-request-id"))
    if request_id is None:
        raise RequestError("missing required x-request-id header")
    model = _ascii_trimmed(headers.get("x-model"))
    if model is None:
        raise RequestError("missing required x-model header")
    raw_tokens = headers.get("x-input-tokens")
    if raw_tokens is None:
        raise RequestError("missing required x-input-tokens header")
    tokens = raw_tokens.strip()
    if not (tokens.isascii() and tokens.isdigit()) or int(tokens) > U64_MAX:
        raise RequestError("invalid x-input-tokens header")
    priority: int | None = None
    raw_priority = headers.get("x-priority")
    if raw_priority is not None:
        p = raw_priority.strip()
        if not (p.isascii() and p.isdigit()) or int(p) > U32_MAX:
            raise RequestError("invalid x-priority header")
        priority = int(p)
    routing_key = (headers.get("x-routing-key") or "").strip() or None
    return RequestMeta(request_id, model, int(tokens), priority, routing_key)


def dynamo_priority(priority: int | None, ceiling: int) -> int:
    """``C - min(p, C)`` with ``C = min(ceiling, 2^31-1)``; absent priority is the lowest (0)."""
    c = min(ceiling, PRIORITY_MAX)
    rank = c if priority is None else min(priority, c)
    return c - rank


def upstream_headers(
    headers: Iterable[tuple[str, str]], *, retry_header: str, priority: int | None, dynamo_ceiling: int | None
) -> CIMultiDict[str]:
    """Filtered request headers for the engine; ``dynamo_ceiling`` None = no priority headers."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers:
        lowered = name.lower()
        if lowered in _REQUEST_DROP or lowered == retry_header:
            continue
        out.add(name, value)
    if dynamo_ceiling is not None:
        out[DYNAMO_PRIORITY] = str(dynamo_priority(priority, dynamo_ceiling))
        out[DYNAMO_STRICT] = "0"
    return out


def retry_after_ms(value: str | None, now_s: float | None = None) -> int | None:
    """``Retry-After`` as milliseconds: delta seconds, or time until an HTTP-date (0 if past)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return int(value) * 1000
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
    """Relayed headers plus retry metadata; second value = non-retryable failure reason, if any."""
    out: CIMultiDict[str] = CIMultiDict()
    authorized = False
    retry_after: str | None = None
    for name, value in upstream:
        lowered = name.lower()
        if lowered == policy.header:
            authorized = value.strip().lower() == "true"
            continue
        if lowered in _RESPONSE_DROP:
            continue
        if lowered == "retry-after":
            retry_after = value
        out.add(name, value)
    if 200 <= status < 300:
        return out, None
    if status in policy.statuses and (authorized or not policy.require_header):
        out["x-stargate-retryable"] = "true"
        out["x-stargate-retry-reason"] = "upstream_admission_rejected"
        ms = retry_after_ms(retry_after) if policy.propagate_retry_after else None
        if ms is not None:
            out["x-stargate-retry-after-ms"] = str(ms)
        return out, None
    return out, (
        "missing_upstream_retry_header" if status in policy.statuses else "upstream_nonretryable_status"
    )
