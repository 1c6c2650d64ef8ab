"""Fuzz cases for a live fleet: fuzzed contract headers and request bodies, malformed HTTP/1.1 framing
(fuzzed gRPC registrations are in ``fuzz_registration``), and the raw socket exchange that sends what
no HTTP client would.

Generation is seeded (``random.Random``), so a run is repeatable. What counts as an answer the spec
documents is decided here once (``DOCUMENTED_STATUSES``) for the bench and the tests alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import random
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from stargate.wire import headers as h
from stargate.wire.limits import U32_MAX, U64_MAX

DOCUMENTED_STATUSES = frozenset({200, 400, 404, 405, 413, 415, 417, 422, 429, 503})
"""Stargate's own answers (stargate.md §4.6: 400, 404, 413, 503), Pylon's (pylon.md §11: 400, 413, 429,
503), the mock engine's passed through (404 unknown model, 415 no JSON content type, 422 not an
object), the web framework's 405 and 417 (unsupported ``Expect``), and success."""

NUMERIC_HEADERS = (h.INPUT_TOKENS, h.PRIORITY, h.MAX_WAIT_MS, h.REQUEST_SLO_MS, h.RETRY_BUDGET_MS)
TEXT_HEADERS = (h.REQUEST_ID, h.MODEL, h.ROUTING_KEY, h.ROUTING_METHOD, h.CACHE_AFFINITY_KEY)
OTHER_HEADERS = ("content-type", "content-encoding", "connection", "expect", h.INFERENCE_SERVER_ID,
                 h.RETRYABLE, h.ERROR_CODE, "content-length")  # fmt: skip
PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/embeddings")
_NUMBERS = ("+5", " 7\t", "007", "-1", "1e3", "0x10", "1_000", "NaN", "inf", "", " ", "+", "١٢",
            str(U64_MAX), str(U64_MAX + 1), str(U32_MAX), str(U32_MAX + 1), "-" + str(U64_MAX))  # fmt: skip
_METHODS = ("round-robin", "power-of-n", "pulsar", "wait-and-widen", "pulsar-wait-and-widen", "bogus", " ")
_NO_LINE_BREAK = re.compile(r"[\r\n]")
_ENCODINGS = ("gzip", "br", "deflate", "identity", "zstd", "gzip, gzip", "x-unknown", "")


def undocumented_5xx(status: int | None) -> bool:
    return status is not None and status >= 500 and status not in DOCUMENTED_STATUSES


def fuzz_text(rng: random.Random, size: int) -> str:
    """Printable ASCII, or unicode and control characters (CR and LF are replaced when sent)."""
    pools = (string.printable, "éü中文\u200b\ufeff\x7f\x00\x01\t ")
    pool = rng.choice(pools)
    return "".join(rng.choice(pool) for _ in range(size))


def fuzz_value(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        return str(rng.randrange(-(2**70), 2**70))
    if kind == 1:
        return "9" * rng.choice((19, 20, 21, 64, 65, 4300, 4301, 6000))
    if kind == 2:
        return "0" * rng.randrange(1, 5000) + str(rng.randrange(100))
    if kind == 3:
        return rng.choice(_NUMBERS)
    if kind == 4:
        return rng.choice(_METHODS)
    return fuzz_text(rng, rng.choice((0, 1, 8, 40, 2000)))


def fuzz_headers(rng: random.Random, model: str, request_id: str) -> dict[str, str]:
    """A valid request's headers with one to four of them replaced, dropped or added."""
    headers = valid_headers(model, request_id)
    for _ in range(rng.randrange(1, 5)):
        name = rng.choice(NUMERIC_HEADERS + TEXT_HEADERS + OTHER_HEADERS)
        if name == "content-length":
            continue  # ``request_bytes`` frames the body; conflicting lengths are framing cases
        action = rng.randrange(5)
        if action == 0 and name in headers:
            del headers[name]
        elif name == "content-encoding":
            headers[name] = rng.choice(_ENCODINGS)
        else:
            headers[name] = fuzz_value(rng)
    return headers


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.choice((None, True, False))
    if kind == 1:
        return rng.choice((0, -1, 2**63 - 1, -(2**63), 1.5, 1e308, -0.0))
    if kind == 2:
        return fuzz_text(rng, rng.randrange(0, 30))
    if kind == 3:
        return rng.randrange(-1000, 1000)
    if kind == 4:
        return ""
    if kind < 7:
        return {fuzz_text(rng, 4): _json_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return [_json_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def valid_headers(model: str, request_id: str) -> dict[str, str]:
    return {h.REQUEST_ID: request_id, h.MODEL: model, h.INPUT_TOKENS: "5", "content-type": "application/json"}


def plain_headers(request_id: str) -> dict[str, str]:
    """What an OpenAI client sends: Stargate's plain-client mode reads the model and the prompt
    from the body."""
    return {h.REQUEST_ID: request_id, "content-type": "application/json"}


def valid_body(model: str) -> bytes:
    return orjson.dumps(chat_body(model))


def chat_body(model: str, max_tokens: object = 2) -> dict[str, object]:
    return {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip


def fuzz_body(rng: random.Random, model: str) -> tuple[bytes, dict[str, str]]:
    """A request body and the headers it needs (content-encoding); valid bodies stay likely."""
    kind = rng.randrange(11)
    if kind == 0:
        return rng.randbytes(rng.choice((0, 1, 100, 5000))), {}
    if kind == 1:
        return orjson.dumps(_json_value(rng)), {}
    if kind == 2:
        big = rng.choice((2**64, -(2**64), 10**400, -1, 0))
        return b'{"model":"%s","stream":true,"max_tokens":%d,"n":%d,"messages":[]}' % (
            model.encode(), big, big), {}  # fmt: skip
    if kind == 3:
        body = orjson.dumps(chat_body(model))
        good = rng.random() < 0.5
        return (gzip.compress(body) if good else body[:10]), {"content-encoding": "gzip"}
    if kind == 4:
        return b'{"stream": true, "max_tokens": 1e400, "temperature": NaN}', {}
    if kind == 5:
        content = fuzz_text(rng, rng.choice((1, 100, 20000)))
        return orjson.dumps({**chat_body(model), "messages": [{"role": "user", "content": content}]}), {}
    if kind == 6:
        return orjson.dumps({**chat_body(model), "stream": rng.choice((False, None, "true", 1))}), {}
    if kind == 7:  # JSON parsers stop at some depth (orjson at 1 024), recursive walkers earlier
        depth = rng.choice((100, 600, 1000, 1100))
        nested = b"[" * depth + b'"x"' + b"]" * depth
        return b'{"model":"%s","stream":true,"messages":%s}' % (model.encode(), nested), {}
    if kind == 8:  # plain-client mode takes the cache-affinity key from these fields
        keys = {field: rng.choice(KEY_VALUES) for field in ("prompt_cache_key", "user") if rng.random() < 0.7}
        return orjson.dumps({**chat_body(model), **keys}), {}
    return orjson.dumps(chat_body(model, rng.choice((1, 2, 3)))), {}


KEY_VALUES: tuple[object, ...] = (
    "conversation-1", "", "  ", "a\r\nx-injected: 1", "caf\u00e9", "\x00\x7f", "k" * 100_000, 7, None,
    ["k"], {"k": "v"}, True,
)  # fmt: skip
"""Cache-affinity key values: good, blank, header-splitting, non-ASCII, control bytes, huge, not strings."""


@dataclass(frozen=True)
class FramingCase:
    name: str
    data: bytes
    complete: bool = True
    """False: the request promises bytes it never sends (the server may wait; the client gives up)."""


def framing_cases(model: str) -> tuple[FramingCase, ...]:
    """Malformed (and a few odd but valid) HTTP/1.1 requests for ``/v1/chat/completions``."""
    body = orjson.dumps(chat_body(model))
    contract = (b"x-request-id: frame\r\nx-model: %s\r\nx-input-tokens: 5\r\n"
                b"content-type: application/json\r\nconnection: close\r\n") % model.encode()  # fmt: skip
    start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: fuzz\r\n"

    def request(extra: bytes, payload: bytes = b"", length: bool = True) -> bytes:
        framing = b"content-length: %d\r\n" % len(payload) if length else b""
        return start + contract + extra + framing + b"\r\n" + payload

    chunked = b"transfer-encoding: chunked\r\n"
    valid = request(b"", body)
    huge = b"9" * 30
    return (
        FramingCase("bad request line", b"GARBAGE\r\n\r\n"),
        FramingCase("unknown HTTP version", b"POST /v1/chat/completions HTTP/9.9\r\n\r\n"),
        FramingCase("control byte in method", b"P\x01ST /v1/chat/completions HTTP/1.1\r\n\r\n"),
        FramingCase("non-ASCII path", "POST /v1/chat/\u00e9 HTTP/1.1\r\nhost: x\r\n\r\n".encode()),
        FramingCase("space in header name", request(b"bad header: 1\r\n", body)),
        FramingCase("NUL in header value", request(b"x-routing-key: a\x00b\r\n", body)),
        FramingCase("obsolete line folding", request(b"x-routing-key: a\r\n  folded\r\n", body)),
        FramingCase("latin-1 header value", request(b"x-cache-affinity-key: \xff\xfe\r\n", body)),
        FramingCase("oversized header line", request(b"x-big: " + b"a" * 70_000 + b"\r\n", body)),
        FramingCase("ten thousand headers", request(b"".join(b"x-h%d: v\r\n" % i for i in range(10_000)))),
        FramingCase("conflicting content-length", request(b"content-length: 3\r\n", body)),
        FramingCase("negative content-length", request(b"content-length: -1\r\n", length=False)),
        FramingCase("overflowing content-length", request(b"content-length: 9%s\r\n" % huge, length=False)),
        FramingCase("content-length with transfer-encoding", request(chunked, b"0\r\n\r\n")),
        FramingCase("bad chunk size", request(chunked, b"ZZ\r\nabc\r\n0\r\n\r\n", False)),
        FramingCase("overflowing chunk size", request(chunked, b"F" * 30 + b"\r\nabc\r\n", False)),
        FramingCase("chunk longer than its size", request(chunked, b"5\r\nabcdefgh\r\n0\r\n\r\n", False)),
        FramingCase("LF-only line ends", valid.replace(b"\r\n", b"\n")),
        FramingCase("absolute-form target", valid.replace(b"POST /v1", b"POST http://evil/v1", 1)),
        FramingCase("truncated body", request(b"content-length: %d\r\n" % (len(body) + 9), body, False),
                    complete=False),
        FramingCase("truncated headers", start + b"x-request-id: r\r\nx-mo", complete=False),
        FramingCase("valid request", valid),
    )


def request_bytes(path: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """One HTTP/1.1 POST exactly as given (any byte a header value can hold but CR and LF), framed by
    Content-Length; ``connection: close`` goes first, so the server closes after its answer."""
    lines = [f"POST {path} HTTP/1.1", "host: fuzz", "connection: close", f"content-length: {len(body)}"]
    lines += [f"{name}: {_NO_LINE_BREAK.sub(' ', value)}" for name, value in headers.items()]
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


@dataclass(frozen=True)
class RawAnswer:
    status: int | None  # None: no status line (closed, or nothing within the timeout)
    closed: bool  # the server closed the connection (after its answer, if any) within the timeout


async def exchange(addr: str, data: bytes, timeout_s: float) -> RawAnswer:
    """Send ``data`` on a fresh connection and read until the server closes or ``timeout_s``."""
    host, _, port = addr.rpartition(":")
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    received = b""
    closed = False
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout_s):
                while chunk := await reader.read(65536):
                    if len(received) < 4096:
                        received += chunk
                closed = True
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return RawAnswer(status_of(received), closed)


def status_of(response: bytes) -> int | None:
    """The final status of a response (interim 1xx answers such as ``100 Continue`` skipped)."""
    while True:
        line = response.split(b"\r\n", 1)[0].split()
        if len(line) < 2 or not line[0].startswith(b"HTTP/") or not line[1].isdigit():
            return None
        status = int(line[1])
        _, sep, response = response.partition(b"\r\n\r\n")
        if not 100 <= status < 200 or not sep:
            return status
