"""The aiohttp server of Stargate's and Pylon's listeners: a request-head timeout and quiet client faults.

aiohttp has no request-head deadline: a client that opens connections and trickles header bytes
(slowloris) holds them until the keep-alive timeout, an hour by default. ``GuardedAppRunner`` serves
an application with ``GuardedRequestHandler``, which closes a connection whose request head is not
complete within ``header_read_timeout_s``, counted from the connection's start for the first
request and from the first byte of each later one (Go's ``ReadHeaderTimeout``); idle keep-alive
connections stay governed by aiohttp's keep-alive timeout, request bodies by the handlers. (The one
head the deadline cannot see is a partial one sent in the same packet as a complete request: the
parser keeps it to itself, and aiohttp's keep-alive timeout bounds it.)

aiohttp logs every malformed request (and every handler error, including a client that hung up) at
ERROR with a traceback. Faults the client caused become one rate-limited WARNING line
(``ClientFaults``); every other error keeps aiohttp's ERROR and traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from stargate.wire.client_faults import ClientFaults, Fault, detail


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a request-head deadline and client-fault logging.

    Relies on three attributes of aiohttp's ``RequestHandler`` (checked by the tests): ``_waiter``
    is pending exactly while the connection waits for a request head, ``_messages`` holds the heads
    parsed and not yet handled, ``_current_request`` is the request being handled.
    """

    __slots__ = ("_faults", "_head_timeout_s", "_head_timer", "_peer")

    def __init__(
        self, manager: web.Server, *, faults: ClientFaults, header_read_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._faults = faults
        self._head_timeout_s = header_read_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._peer = "unknown peer"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._peer = f"{peer[0]}:{peer[1]}"
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        # Only bytes start a head: aiohttp also calls this with b"" whenever a handler reads its
        # body (resume_reading), which would arm the deadline per request and on idle keep-alives.
        head_starts = (
            bool(data) and self._head_timer is None and (self._awaiting_head() or self._body_complete())
        )
        super().data_received(data)
        if self._messages:
            self._cancel_head_timer()
        elif head_starts:
            self._arm_head_timer()  # the first bytes of a later request's head, not complete yet

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's error log: client faults become one rate-limited WARNING, the rest stay ERROR."""
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            message = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
            self._faults.report(
                Fault.MALFORMED,
                "rejected a malformed request from %s: %s",
                self._peer,
                detail(message) or type(exc).__name__,
            )
        elif isinstance(exc, ConnectionError) and (self.transport is None or self.transport.is_closing()):
            self._faults.report(
                Fault.RESPONSE_ABANDONED,
                "client %s closed the connection before the response was complete",
                self._peer,
            )
        else:
            super().log_exception(*args, **kw)

    def _awaiting_head(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _body_complete(self) -> bool:
        """A request is being handled and its body is all in: bytes arriving now start the next head."""
        current = self._current_request
        return current is not None and current.content.is_eof()

    def _arm_head_timer(self) -> None:
        if self._head_timeout_s > 0:
            self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None:
            return
        if not self._awaiting_head():
            # A head pipelined behind a request still being handled: due once that request is done.
            self._arm_head_timer()
            return
        self._faults.report(
            Fault.SLOW_HEAD,
            "closed the connection from %s: no complete request head within %d ms",
            self._peer,
            round(self._head_timeout_s * 1000),
        )
        self.force_close()


class _GuardedServer(web.Server):
    """aiohttp's server (the protocol factory) making ``GuardedRequestHandler`` connections."""

    def __init__(self, base: web.Server, faults: ClientFaults, header_read_timeout_s: float) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **base._kwargs,
        )
        self._faults = faults
        self._header_read_timeout_s = header_read_timeout_s

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(
            self,
            faults=self._faults,
            header_read_timeout_s=self._header_read_timeout_s,
            loop=self._loop,
            **self._kwargs,
        )


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are ``GuardedRequestHandler``; 0 disables the timeout."""

    def __init__(
        self, app: web.Application, *, faults: ClientFaults, header_read_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._faults = faults
        self._header_read_timeout_s = header_read_timeout_s

    async def _make_server(self) -> web.Server:
        return _GuardedServer(await super()._make_server(), self._faults, self._header_read_timeout_s)


def report_client_gone(
    faults: ClientFaults, request: web.BaseRequest, request_id: str | None, *, started: bool
) -> bool:
    """When ``request``'s client has hung up, log one line naming what it abandoned; else False.

    ``started``: the response head was sent.
    """
    transport = request.transport
    if transport is not None and not transport.is_closing():
        return False
    where = f" (request id {detail(request_id)})" if request_id else ""
    if request.body_exists and not request.content.is_eof():
        faults.report(
            Fault.REQUEST_ABANDONED,
            "client closed the connection before its request body was complete%s",
            where,
        )
    else:
        moment = "mid-response" if started else "before the response started"
        faults.report(Fault.RESPONSE_ABANDONED, "client closed the connection %s%s", moment, where)
    return True
