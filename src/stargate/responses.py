"""The one function that turns an error into an HTTP response, for Stargate and Pylon alike.

Every body carries the OpenAI error object ``{"error": {"message", "type", "code"}}``, so any OpenAI
client's exception message says what was wrong. Where a spec fixes a body it is kept:

* Stargate's two wire codes (spec §4.6: 404 ``no_eligible_candidates``, 503
  ``input_work_limit_exceeded``) keep their exact body ``{"error": <message>, "code": <code>}`` and
  the ``x-stargate-error-code`` header;
* Pylon's bodies (pylon.md §11) stay RFC 7807 ``application/problem+json`` with ``type``, ``title``,
  ``status``, ``detail`` (and the §8.3 fields of a queue mismatch); the OpenAI ``error`` object is
  added beside them.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from stargate.errors import StargateError
from stargate.wire import headers as h

REASONS = {
    400: "Bad Request",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


def error_body(exc: StargateError, *, problem: bool = False) -> dict[str, object]:
    if exc.wire_code and not problem:
        return {"error": exc.message, "code": exc.code}
    openai = {"message": exc.message, "type": exc.kind, "code": exc.code}
    if not problem:
        return {"error": openai}
    body: dict[str, object] = {
        "type": "about:blank",
        "title": REASONS.get(exc.status, "Error"),
        "status": exc.status,
        "detail": exc.message,
    }
    body.update(exc.extra_fields())
    body["error"] = openai
    return body


def error_response(exc: StargateError, *, problem: bool = False) -> web.Response:
    """The response for ``exc``; ``problem`` selects Pylon's RFC 7807 form (pylon.md §11)."""
    headers = dict(exc.retry_headers())
    if exc.wire_code and not problem:
        headers[h.ERROR_CODE] = exc.code
    return web.Response(
        status=exc.status,
        body=orjson.dumps(error_body(exc, problem=problem)),
        content_type="application/problem+json" if problem else "application/json",
        headers=headers,
    )
