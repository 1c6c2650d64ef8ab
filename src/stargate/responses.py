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

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from stargate.errors import MethodNotAllowed, NoSuchEndpoint, StargateError
from stargate.wire import headers as h
from stargate.wire.client_faults import detail

REASONS = {
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
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


@web.middleware
async def json_route_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """An unknown path or method gets the JSON error body too, not aiohttp's plain-text page."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"{request.method} is not allowed on {detail(request.path)} (allowed: {allowed})"
        response = error_response(MethodNotAllowed(message))
        response.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
        return response
    except web.HTTPNotFound:
        # Client bytes quoted short: an 8 KB path came back whole.
        return error_response(NoSuchEndpoint(f"no such endpoint: {request.method} {detail(request.path)}"))
