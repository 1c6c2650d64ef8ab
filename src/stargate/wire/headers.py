"""Header names of the wire contract and the one parser both Stargate and Pylon use for them.

Values follow stargate.md §4.2 (Pylon's rules in pylon.md §7 are the same contract): a *text*
value is visible ASCII, trimmed of spaces and tabs, blank = absent; a *number* is trimmed decimal
digits with an optional leading ``+`` (leading zeros fine), in range for its type. The parser never
raises anything but ``InvalidNumber`` whatever the input, and never hands Python's ``int()`` a digit
string longer than a u64 can be.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from multidict import CIMultiDict

from stargate.wire.limits import MAX_REQUEST_HEADER_FIELDS

REQUEST_ID = "x-request-id"
MODEL = "x-model"
INPUT_TOKENS = "x-input-tokens"
ROUTING_KEY = "x-routing-key"
ROUTING_METHOD = "x-routing-method"
PRIORITY = "x-priority"
MAX_WAIT_MS = "x-max-wait-ms"
REQUEST_SLO_MS = "x-request-slo-ms"
CACHE_AFFINITY_KEY = "x-cache-affinity-key"
RETRY_BUDGET_MS = "x-stargate-max-wait-ms"
RETRYABLE = "x-stargate-retryable"
RETRY_REASON = "x-stargate-retry-reason"
RETRY_AFTER_MS = "x-stargate-retry-after-ms"
EXPECTED_QUEUE_MS = "x-stargate-expected-queue-ms"
ERROR_CODE = "x-stargate-error-code"
UPSTREAM_RETRYABLE = "x-stargate-upstream-retryable"
INFERENCE_SERVER_ID = "x-inference-server-id"
INFERENCE_SERVER_URL = "x-inference-server-url"
CLUSTER_ID = "x-stargate-cluster-id"
HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"
"""gRPC metadata key of a registration stream: the Pylon's heartbeat interval."""
WATCH_HEARTBEAT_METADATA = "x-stargate-watch-heartbeat-ms"
"""Initial metadata of a discovery watch (not in the original): the longest gap between Stargate's
snapshots (``--watch-heartbeat-ms``), so a Pylon can tell a silent connection from a quiet one."""
SESSION_ID = "x-session-id"
"""Plain-client mode's default session header (and vLLM's router's session key)."""
TUNNEL_METHOD = "x-method"
TUNNEL_PATH = "x-path"
"""Set only by the original's tunnel transport (pylon.md §1); Pylon drops them before the engine."""
VIA = "via"
"""Each router a request passed names itself here (RFC 9110 §7.6.3), so one that comes back is seen."""
DYNAMO_PRIORITY = "x-dynamo-request-priority"
DYNAMO_STRICT_PRIORITY = "x-dynamo-request-strict-priority"
"""Pylon → Dynamo engine priority band (pylon.md §8.4)."""

# The mock engine's contract (mock-engine.md), read back by the bench.
OUTPUT_TOKENS = "x-output-tokens"
MOCK_BACKEND_ID = "x-mock-backend-id"
MOCK_INPUT_TOKENS = "x-mock-input-tokens"
MOCK_OUTPUT_TOKENS = "x-mock-output-tokens"
KV_CACHE_HIT = "x-kv-cache-hit"
KV_CACHE_EVICTED_ENTRIES = "x-kv-cache-evicted-entries"
KV_CACHE_EVICTED_TOKENS = "x-kv-cache-evicted-tokens"
KV_CACHE_REUSED_INPUT_TOKENS = "x-kv-cache-reused-input-tokens"
KV_CACHE_UNCACHED_INPUT_TOKENS = "x-kv-cache-uncached-input-tokens"

HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
)
RETRY_METADATA = frozenset({RETRYABLE, RETRY_REASON, RETRY_AFTER_MS, EXPECTED_QUEUE_MS, ERROR_CODE})
IDENTITY = frozenset({INFERENCE_SERVER_ID, INFERENCE_SERVER_URL, CLUSTER_ID})
"""Set by Stargate on every proxied response; a client's copies are never forwarded."""

MAX_NUMBER_LENGTH = 64
"""Digits beyond leading zeros that are examined at all: far above u64's 20, far below int()'s limit."""

_NOT_VISIBLE = re.compile(r"[^\t -~]")


class InvalidNumber(ValueError):
    """A numeric header value the contract rejects; the message says why (no value echoed at length)."""


def is_visible_ascii(raw: str) -> bool:
    """Tab, space and printable ASCII only."""
    return raw.isascii() and _NOT_VISIBLE.search(raw) is None


MAX_MODEL_ID_CHARS = 512
"""Longest model id a registration may list: each is a metrics label and a ``/v1/models`` entry."""


def valid_header_value(value: str) -> bool:
    """Visible ASCII a header carries as is: no spaces or tabs around it for a hop to trim."""
    return is_visible_ascii(value) and value == value.strip(" \t")


def model_id_problem(model_id: str) -> str | None:
    """Why no request could name ``model_id`` (``x-model`` is trimmed visible ASCII), or None."""
    if not model_id:
        return "model id is empty"
    return identity_problem("model id", model_id, MAX_MODEL_ID_CHARS)


MAX_ID_CHARS = 512
"""Longest ``inference_server_id``/``cluster_id``: every health probe carries the id in a header,
and a megabyte id made each probe fail (header too long) and each log line a megabyte."""


def identity_problem(name: str, value: str, limit: int = MAX_ID_CHARS) -> str | None:
    """Why Stargate refuses ``value`` as a registration's ``name`` field, or None: it sets the
    identity as a header on every response it proxies for the backend."""
    if value and not valid_header_value(value):
        return f"{name} must be visible ASCII without surrounding spaces"
    if len(value) > limit:
        return f"{name} is longer than {limit} characters"
    return None


def text_value(raw: str | None) -> str | None:
    """Trimmed visible-ASCII value; non-ASCII or blank counts as absent."""
    if raw is None or not is_visible_ascii(raw):
        return None
    value = raw.strip(" \t")
    return value or None


def parse_unsigned(raw: str, limit: int) -> int:
    """Decimal digits, optional leading ``+``, in ``0..=limit``; anything else raises ``InvalidNumber``."""
    if not is_visible_ascii(raw):
        raise InvalidNumber("must be visible ASCII")
    value = raw.strip(" \t")
    digits = value[1:] if value[:1] == "+" else value
    if not digits or not digits.isdigit():
        raise InvalidNumber("must be an unsigned decimal integer")
    significant = digits.lstrip("0")
    if len(significant) > MAX_NUMBER_LENGTH:
        raise InvalidNumber("is out of range")
    number = int(significant) if significant else 0
    if number > limit:
        raise InvalidNumber("is out of range")
    return number


def optional_unsigned(raw: str | None, limit: int) -> int | None:
    """``parse_unsigned`` that reads an invalid or absent value as ``None`` (advisory headers)."""
    if raw is None:
        return None
    try:
        return parse_unsigned(raw, limit)
    except InvalidNumber:
        return None


def via_names(values: Iterable[str]) -> Iterator[str]:
    """The ``received-by`` name of every ``Via`` entry (``1.1 name (comment)``), in order."""
    for value in values:
        for entry in value.split(","):
            parts = entry.split()
            if len(parts) >= 2:
                yield parts[1]


def connection_nominated(items: Iterable[tuple[str, str]]) -> frozenset[str]:
    """Lower-cased names listed in ``Connection`` headers: hop-by-hop for this hop only (RFC 9110 §7.6.1)."""
    return nominated_names(value for name, value in items if name.lower() == "connection")


def nominated_names(connection_values: Iterable[str]) -> frozenset[str]:
    """Lower-cased names listed in these ``Connection`` header values."""
    names = {token.strip(" \t").lower() for value in connection_values for token in value.split(",")}
    names.discard("")
    return frozenset(names)


def without_names(headers: CIMultiDict[str], names: frozenset[str]) -> CIMultiDict[str]:
    """``headers`` less every field whose lower-cased name is in ``names`` (order kept)."""
    if not names:
        return headers
    return CIMultiDict((name, value) for name, value in headers.items() if name.lower() not in names)


def forwardable(items: Iterable[tuple[str, str]], dropped: frozenset[str]) -> CIMultiDict[str]:
    """Headers (multi-values and order kept) less ``dropped``, hop-by-hop and Connection-nominated names.

    One pass over ``items`` (this runs per relayed request): nominated names are taken out afterwards,
    only when a ``Connection`` header lists any.
    """
    out: CIMultiDict[str] = CIMultiDict()
    connection: list[str] = []
    for name, value in items:
        lowered = name.lower()
        if lowered == "connection":
            connection.append(value)
        elif lowered not in dropped and lowered not in HOP_BY_HOP:
            out.add(name, value)
    return without_names(out, nominated_names(connection)) if connection else out


def too_many_fields(count: int, limit: int = MAX_REQUEST_HEADER_FIELDS) -> str | None:
    """What is wrong with a request of ``count`` header fields, if more than ``limit``."""
    if count <= limit:
        return None
    return f"the request has {count} header fields, at most {limit} are taken"
