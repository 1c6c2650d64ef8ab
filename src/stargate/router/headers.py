"""The proxy's header contract: request parsing (spec §4.2) and forwarding filters (§4.3, §4.4).

Parsing follows the spec's validation order exactly (first failure wins). Every failure is a
``RequestError`` (400; the balancer's ``RoutingMethodError`` is translated here) or ``PayloadTooLarge`` (413);
``stargate.responses.error_response`` turns it into a short JSON body.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from multidict import CIMultiDict, MultiMapping

from stargate.balancer.config import parse_routing_method
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import Target
from stargate.errors import PayloadTooLarge, RequestError, RequestLoop, RoutingMethodError, StargateError
from stargate.wire import headers as h
from stargate.wire.headers import HOP_BY_HOP, IDENTITY, RETRY_METADATA, text_value
from stargate.wire.limits import U32_MAX, U64_MAX

MAX_WAIT_CAP_MS = 60_000

REQUEST_DROPPED = HOP_BY_HOP | RETRY_METADATA | IDENTITY | {"host", h.ROUTING_METHOD}
REQUEST_CONTRACT = (h.REQUEST_ID, h.MODEL, h.INPUT_TOKENS)
"""Forwarded even when the client's ``Connection`` names them: the next hop requires them too."""
MAX_VIA_CHARS = 4096
"""Longest ``Via`` accepted: the router adds its own entry, and the next hop's header limit is 8 KiB."""
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


def parse_unsigned(name: str, raw: str, limit: int) -> int:
    """The shared numeric rule (``stargate.wire.headers``); a rejected value → 400."""
    try:
        return h.parse_unsigned(raw, limit)
    except h.InvalidNumber as exc:
        raise _invalid(f"header {name} {exc}") from None


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
    request_id = text_value(headers.get(h.REQUEST_ID))
    if request_id is None:
        raise _invalid("missing required header x-request-id")
    raw_tokens = headers.get(h.INPUT_TOKENS)
    if raw_tokens is None:
        raise _invalid("missing required header x-input-tokens")
    input_tokens = parse_unsigned(h.INPUT_TOKENS, raw_tokens, U64_MAX)
    model_id = text_value(headers.get(h.MODEL))
    if model_id is None:
        raise _invalid("missing required header x-model")
    raw_method = headers.get(h.ROUTING_METHOD)
    requested_method: str | None = None
    algorithm: Algorithm | None = None
    if raw_method is not None:
        requested_method = raw_method.strip(" \t")
        algorithm = _translated(parse_routing_method, raw_method)
    priority = _optional_unsigned(headers, h.PRIORITY, U32_MAX) or 0
    max_wait_ms = _optional_unsigned(headers, h.MAX_WAIT_MS, U64_MAX)
    request_slo_ms = _optional_unsigned(headers, h.REQUEST_SLO_MS, U64_MAX) or None
    definition = _translated(resolve, model_id, algorithm)
    cache_affinity_key = text_value(headers.get(h.CACHE_AFFINITY_KEY))
    if definition.require_cache_affinity_key and cache_affinity_key is None:
        raise _invalid("header x-cache-affinity-key is required for this model")
    retry_budget_ms = (
        _optional_unsigned(headers, retry_budget_header, U64_MAX) if retry_budget_header else None
    )
    declared = h.optional_unsigned(headers.get("content-length"), U64_MAX)
    if declared is not None and declared > max_replay_body_bytes:
        raise PayloadTooLarge(
            f"request body of {declared} bytes exceeds the replay limit of {max_replay_body_bytes} bytes"
        )
    return ProxyRequest(
        request_id=request_id,
        target=Target(text_value(headers.get(h.ROUTING_KEY)), model_id),
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


def via_name() -> str:
    """This router's ``Via`` name: random per process, so two routers given one ``--stargate-id``
    still tell each other apart."""
    return f"stargate-{secrets.token_hex(6)}"


def via_problem(headers: MultiMapping[str], name: str) -> StargateError | None:
    """Why a request's ``Via`` keeps it from going on: it passed the router called ``name``
    before (a backend URL leads back to it), or there is no room left to add ``name``."""
    values = headers.getall(h.VIA, ())
    if not values:
        return None
    if name in h.via_names(values):
        return RequestLoop(name)
    if len(", ".join(values)) > MAX_VIA_CHARS:
        return RequestError(f"via header is longer than {MAX_VIA_CHARS} characters")
    return None


def filter_headers(items: Iterable[tuple[str, str]], dropped: frozenset[str]) -> CIMultiDict[str]:
    """Copy headers except ``dropped``, hop-by-hop and ``Connection``-nominated names (RFC 9110 §7.6.1)."""
    return h.forwardable(items, dropped)


def valid_header_name(name: str) -> bool:
    """RFC 9110 token characters only."""
    allowed = set("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return bool(name) and all(ch in allowed for ch in name)
