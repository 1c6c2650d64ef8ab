"""Content codings of request bodies: read a decoded copy, forward the original bytes.

Stargate and Pylon pass bodies through byte for byte (their servers never decompress). Where a body
must be read (Pylon's JSON checks, plain-client mode, the mock engine) ``decoded`` gives a bounded
decoded copy: a corrupt body is a 400, one that inflates past the limit a 413, a coding it cannot
read a 415.
``off_loop`` reads such a body away from the event loop.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stargate.errors import PayloadTooLarge, RequestError, StargateError, UnsupportedEncoding

T = TypeVar("T")

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


MAX_INFLATION = 100
"""A compressed body decodes to at most this many times its size (and ``INFLATION_FLOOR`` bytes
whatever its size), as zip-bomb guards bound the ratio: JSON prompts compress 3-10 times, and 60 KB
of gzip that held 60 MiB of JSON cost a second of parsing per request within the size limit."""
INFLATION_FLOOR = 1024 * 1024


def content_coding(headers: Mapping[str, str]) -> str | None:
    """The ``Content-Encoding`` list, its header lines joined (RFC 9110 §5.3): a request sending
    ``gzip`` on two lines was read as one gzip while both lines were forwarded."""
    getall = getattr(headers, "getall", None)
    if getall is None:
        return headers.get("content-encoding")
    lines = getall("content-encoding", ())
    return ", ".join(lines) if lines else None


def decoded(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``body`` with its ``Content-Encoding`` undone (codings apply in order, so undo in reverse).

    The error raised carries no traceback into ``_undo``: a frame kept by a traceback kept its
    decoded copy, up to the limit, until the garbage collector's next full pass (twenty rejected
    bombs held 1.4 GB in Pylon)."""
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    too_large = f"decoded request body exceeds {limit} bytes"
    ratio_cap = max(INFLATION_FLOOR, MAX_INFLATION * len(body))
    if ratio_cap < limit:
        limit = ratio_cap
        too_large = f"request body inflates past {MAX_INFLATION} times its {len(body)} bytes"
    try:
        return _undo(body, codings, limit, too_large)
    except StargateError as exc:
        error = exc.with_traceback(None)
    raise error


def _undo(body: bytes, codings: list[str], limit: int, too_large: str) -> bytes:
    for coding in reversed(codings):
        if coding == "identity":
            continue
        wbits = _WBITS.get(coding)
        if wbits is None:
            raise UnsupportedEncoding(f"request bodies with content-encoding {coding!r} are not supported")
        body = _inflate(body, coding, wbits, limit, too_large)
    return body


def _inflate(data: bytes, coding: str, wbits: int, limit: int, too_large: str) -> bytes:
    """Every member of a gzip body (RFC 1952 allows several; one after another they decode to the
    concatenation, as ``gzip.decompress`` reads them); bytes after a deflate stream are an error."""
    parts: list[bytes] = []
    size = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(data, limit + 1 - size)
        except zlib.error:
            raise RequestError(f"request body is not valid {coding} data") from None
        size += len(out)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(too_large)
        if not inflater.eof:
            raise RequestError(f"request body is truncated {coding} data")
        parts.append(out)
        data = inflater.unused_data
        if not data:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if coding == "deflate":
            raise RequestError("request body has bytes after its deflate data")


_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-decode")


async def off_loop(read: Callable[[], T]) -> T:
    """``read()`` (the decoding and parsing of a compressed body) in a worker thread, one body at a
    time per process.

    A small body can inflate to the decoded cap: 60 KB of gzip held 60 MiB of JSON, and decoding
    and parsing it on the event loop stalled every request of a Pylon for 1.4 s (four at once took
    it out of routing on its health probes), while each such body in flight kept its decoded copy.
    zlib lets the event loop run while it inflates; one body at a time bounds the decoded copies
    to one and the event loop's stalls to one parse. A read whose caller is gone before it starts
    is dropped."""
    return await asyncio.get_running_loop().run_in_executor(_READER, read)
