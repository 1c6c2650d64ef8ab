"""The proxy's header contract: request parsing (spec §4.2) and forwarding filters (§4.3, §4.4).

Parsing follows the spec's validation order exactly (first failure wins). Every failure is a
``RequestError`` (400; the balancer's ``RoutingMethodError`` is translated here) or ``PayloadTooLarge`` (413);
``stargate.responses.error_response`` turns it into a short JSON body.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from multidict import CIMultiDict

from stargate.balancer.config import parse_routing_method
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import Target
from stargate.errors import PayloadTooLarge, RequestError, RoutingMethodError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
MAX_WAIT_CAP_MS = 60_000
DEFAULT_RETRY_BUDGET_HEADER = "x-stargate-max-wait-ms"

HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
)
RETRY_METADATA = frozenset(
    {
        "x-stargate-retryable",
        "x-stargate-retry-reason",
        "x-stargate-retry-after-ms",
        "x-stargate-expected-queue-ms",
        "x-stargate-error-code",
    }
)
REQUEST_DROPPED = HOP_BY_HOP | RETRY_METADATA | {"host", "x-routing-method"}
RESPONSE_DROPPED = HOP_BY_HOP | RETRY_METADATA

_T = TypeVar("_T")
ResolveAlgorithm = Callable[[str, Algorithm | None], AlgorithmDefinition]
"""``(model_id, parsed routing method or None) -> definition``; raises ``RoutingMethodError``."""


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """Everything routing needs from one proxied request's headers; times in monotonic seconds."""

    request_id: str
    target: Target
    input_tokens: int
    definition: AlgorithmDefinition
    requested_method: str | None
    priority: int
    max_wait_ms: int | None  # already capped at 60 000
    request_slo_ms: int | None  # 0 is normalised to None
    cache_affinity_key: str | None
    retry_budget_ms: int | None
    received_at: float


def _invalid(message: str) -> RequestError:
    return RequestError(message)


def _translated(call: Callable[..., _T], *args: object) -> _T:
    """The balancer's routing-method errors become this request's 400 (the one translation)."""
    try:
        return call(*args)
    except RoutingMethodError as exc:
        raise RequestError(exc.message) from exc


def text_value(raw: str | None) -> str | None:
    """Trimmed visible-ASCII value; non-ASCII or blank counts as absent."""
    if raw is None or not is_visible_ascii(raw):
        return None
    value = raw.strip(" \t")
    return value or None


_NOT_VISIBLE = re.compile(r"[^\t -~]")


def is_visible_ascii(raw: str) -> bool:
    """Tab, space and printable ASCII only; one regex scan instead of a per-character loop."""
    return raw.isascii() and _NOT_VISIBLE.search(raw) is None


def parse_unsigned(name: str, raw: str, limit: int) -> int:
    """Decimal digits with an optional leading ``+``; anything else or out of range → 400."""
    if not is_visible_ascii(raw):
        raise _invalid(f"header {name} must be visible ASCII")
    value = raw.strip(" \t")
    digits = value[1:] if value.startswith("+") else value
    if not digits or not digits.isascii() or not digits.isdigit():
        raise _invalid(f"header {name} must be an unsigned decimal integer, got {value!r}")
    number = int(digits)
    if number > limit:
        raise _invalid(f"header {name} is out of range: {value}")
    return number


def _optional_unsigned(headers: Mapping[str, str], name: str, limit: int) -> int | None:
    raw = headers.get(name)
    return None if raw is None else parse_unsigned(name, raw, limit)


def parse_request(
    headers: Mapping[str, str],
    *,
    resolve: ResolveAlgorithm,
    retry_budget_header: str | None,
    max_replay_body_bytes: int,
    received_at: float,
) -> ProxyRequest:
    """Validate one request's headers in the spec's order; ``headers`` is case-insensitive."""
    request_id = text_value(headers.get("x-request-id"))
    if request_id is None:
        raise _invalid("missing required header x-request-id")
    raw_tokens = headers.get("x-input-tokens")
    if raw_tokens is None:
        raise _invalid("missing required header x-input-tokens")
    input_tokens = parse_unsigned("x-input-tokens", raw_tokens, U64_MAX)
    model_id = text_value(headers.get("x-model"))
    if model_id is None:
        raise _invalid("missing required header x-model")
    raw_method = headers.get("x-routing-method")
    requested_method: str | None = None
    algorithm: Algorithm | None = None
    if raw_method is not None:
        requested_method = raw_method.strip(" \t")
        algorithm = _translated(parse_routing_method, raw_method)
    priority = _optional_unsigned(headers, "x-priority", U32_MAX) or 0
    max_wait_ms = _optional_unsigned(headers, "x-max-wait-ms", U64_MAX)
    request_slo_ms = _optional_unsigned(headers, "x-request-slo-ms", U64_MAX) or None
    definition = _translated(resolve, model_id, algorithm)
    cache_affinity_key = text_value(headers.get("x-cache-affinity-key"))
    if definition.require_cache_affinity_key and cache_affinity_key is None:
        raise _invalid("header x-cache-affinity-key is required for this model")
    retry_budget_ms = (
        _optional_unsigned(headers, retry_budget_header, U64_MAX) if retry_budget_header else None
    )
    content_length = headers.get("content-length")
    if content_length is not None:
        declared = content_length.strip()
        if declared.isascii() and declared.isdigit() and int(declared) > max_replay_body_bytes:
            raise PayloadTooLarge(
                f"request body of {declared} bytes exceeds the replay limit of {max_replay_body_bytes} bytes"
            )
    return ProxyRequest(
        request_id=request_id,
        target=Target(text_value(headers.get("x-routing-key")), model_id),
        input_tokens=input_tokens,
        definition=definition,
        requested_method=requested_method,
        priority=priority,
        max_wait_ms=None if max_wait_ms is None else min(max_wait_ms, MAX_WAIT_CAP_MS),
        request_slo_ms=request_slo_ms,
        cache_affinity_key=cache_affinity_key,
        retry_budget_ms=retry_budget_ms,
        received_at=received_at,
    )


def filter_headers(items: Iterable[tuple[str, str]], dropped: frozenset[str]) -> CIMultiDict[str]:
    """Copy headers (multi-values preserved, order kept) except the ``dropped`` names."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        if name.lower() not in dropped:
            out.add(name, value)
    return out


def valid_header_name(name: str) -> bool:
    """RFC 9110 token characters only."""
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and all(ch in allowed for ch in name)


def valid_header_value(value: str) -> bool:
    return is_visible_ascii(value) and value == value.strip(" \t")
