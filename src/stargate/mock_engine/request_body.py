"""A request body as the handlers read it: its ``Content-Encoding`` undone by the code Pylon and the
router use (``stargate.body_coding``).

The server decompresses nothing (``start_server`` turns aiohttp's decompression off): aiohttp read
a coding it does not know, or gzip without its trailer, as a plain body, and ``gzip, gzip`` as one
layer, where Pylon and the router answer 415 and 400.
"""

from __future__ import annotations

import functools

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from stargate.body_coding import content_coding, decoded, off_loop
from stargate.errors import PayloadTooLarge, RequestError, UnsupportedEncoding
from stargate.wire.client_faults import detail


async def read_body(request: web.Request) -> bytes:
    """The decoded body: 400 unreadable or corrupt, 413 decoding past the body limit (or 100 times
    its size), 415 a coding other than gzip, deflate and identity."""
    try:
        raw = await request.read()
    except RequestPayloadError as exc:  # a body its transfer coding does not decode
        # The rest of the body is not read, so the connection cannot carry another request.
        reason = f"request body cannot be decoded: {detail(str(exc))}"
        raise web.HTTPBadRequest(text=reason, headers={"connection": "close"}) from exc
    coding = content_coding(request.headers)
    if not coding:
        return raw
    limit = request.client_max_size
    try:
        return await off_loop(functools.partial(decoded, raw, coding, limit))
    except UnsupportedEncoding as exc:
        raise web.HTTPUnsupportedMediaType(text=exc.message) from exc
    except PayloadTooLarge as exc:
        raise web.HTTPRequestEntityTooLarge(limit, len(raw), text=exc.message) from exc
    except RequestError as exc:
        raise web.HTTPBadRequest(text=exc.message) from exc
