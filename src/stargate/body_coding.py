"""Content codings of request bodies: read a decoded copy, forward the original bytes.

Stargate and Pylon pass bodies through byte for byte (their servers never decompress). Where a body
must be read (Pylon's JSON checks, plain-client mode) ``decoded`` gives a bounded decoded copy: a
corrupt body is a 400, one that inflates past the limit a 413, a coding it cannot read a 415.
"""

from __future__ import annotations

import zlib

from stargate.errors import PayloadTooLarge, RequestError, UnsupportedEncoding

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decoded(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``body`` with its ``Content-Encoding`` undone (codings apply in order, so undo in reverse)."""
    if not content_encoding:
        return body
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    for coding in reversed(codings):
        if coding == "identity":
            continue
        wbits = _WBITS.get(coding)
        if wbits is None:
            raise UnsupportedEncoding(f"request bodies with content-encoding {coding!r} are not supported")
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as exc:
            raise RequestError(f"request body is not valid {coding} data") from exc
        if len(out) > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(f"decoded request body exceeds {limit} bytes")
        if not inflater.eof:
            raise RequestError(f"request body is truncated {coding} data")
        body = out
    return body
