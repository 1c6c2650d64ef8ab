"""The aiohttp server of Stargate's and Pylon's listeners: client timeouts and quiet client faults.

aiohttp bounds no client: one that trickles header bytes (slowloris) holds its connection until the
keep-alive timeout, an hour by default, and one that stops sending its request body, or stops
reading the answer, holds it (and the request upstream, an engine slot included) for as long as it
stays connected. ``GuardedAppRunner`` serves an application with ``GuardedRequestHandler``, which
closes a connection (``ClientTimeouts``, each 0 disables):

- whose request head is not complete within ``head_s``, counted from the connection's start for the
  first request and from the first byte of each later one (Go's ``ReadHeaderTimeout``). (The one
  head the deadline cannot see is a partial one sent in the same packet as a complete request: the
  parser keeps it to itself, and aiohttp's keep-alive timeout bounds it.)
- whose request body, once begun, sends nothing for ``body_s`` while the server reads it (nginx's
  ``client_body_timeout``);
- that reads nothing of the answer for ``send_s`` while the answer waits in a full send buffer
  (nginx's ``send_timeout``): the transport paused writing and did not resume.

An idle keep-alive connection is closed after ``IDLE_KEEPALIVE_S`` (nginx's ``keepalive_timeout``;
aiohttp's default is an hour, so one client holding idle connections used up the process's file
descriptors). The handler of a closed connection is cancelled (``handler_cancellation``), which
cancels its request upstream.

aiohttp logs every malformed request (and every handler error, including a client that hung up) at
ERROR with a traceback. Faults the client caused become one rate-limited WARNING line
(``ClientFaults``); every other error keeps aiohttp's ERROR and traceback. aiohttp answers a
request it cannot parse (and a handler that raised) with a plain-text page; here it gets the JSON
error body of every other error (``stargate.responses``): 400 ``invalid_request`` (the spec's status
for a header violation) naming what was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import math
import socket
import struct
import termios
from dataclasses import dataclass
from typing import Any

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.http_exceptions import BadHttpMethod, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from stargate.errors import ExpectationFailed, HandlerTimedOut, RequestError, StargateError
from stargate.responses import error_response
from stargate.wire.address import join_host_port
from stargate.wire.client_faults import ClientFaults, Fault, detail
from stargate.wire.runner import open_files_limit

_RESET = struct.pack("ii", 1, 0)
"""``SO_LINGER`` on, 0 s: closing sends a RST and discards the send queue."""
MAX_LINE_BYTES = 8190
"""aiohttp's parser limit on the request line and on each header field (neither server changes it)."""


@dataclass(frozen=True, slots=True)
class ClientTimeouts:
    """How long a client may stall its connection (seconds, 0 = no limit): the request head, a
    silence in the request body, an unread answer."""

    head_s: float
    body_s: float
    send_s: float


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with client deadlines and client-fault logging.

    Relies on attributes of aiohttp's ``RequestHandler`` (checked by the tests): ``_waiter`` is
    pending exactly while the connection waits for a request head, ``_messages`` holds the heads
    (with their body streams) parsed and not yet handled, ``_current_request`` is the request being
    handled, ``_reading_paused`` / ``_buffer_paused`` say the server stopped reading,
    ``_lingering_time`` is how long an unread body is read on after the answer.
    """

    __slots__ = (
        "_body_timer",
        "_faults",
        "_head_timer",
        "_last_data",
        "_peer",
        "_problem",
        "_send_timer",
        "_timeouts",
        "_unsent",
        "stopping",
        "timed_out",
    )

    def __init__(
        self,
        manager: web.Server,
        *,
        faults: ClientFaults,
        timeouts: ClientTimeouts,
        problem: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._faults = faults
        self._problem = problem  # Pylon's RFC 7807 error bodies (``error_response``)
        self._timeouts = timeouts
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent: int | None = None  # bytes the kernel held for the client when last checked
        self._last_data = 0.0
        self._peer = "unknown peer"
        self.timed_out = False
        """This side closed the connection on a client deadline (logged then, not again as a hang-up)."""
        self.stopping = False
        """The server closes the connection as it stops (past the drain, logged once, by the owner)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._peer = join_host_port(str(peer[0]), int(peer[1]))
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
        if data and self._timeouts.body_s > 0:
            self._last_data = self._loop.time()
            if self._body_timer is None and self._receiving_body():
                self._body_timer = self._loop.call_later(self._timeouts.body_s, self._check_body)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        for timer in (self._body_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        self._body_timer = self._send_timer = None
        super().connection_lost(exc)

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        self.stopping = True
        await super().shutdown(timeout)

    def pause_writing(self) -> None:
        """The send buffer is full: the client has not read the answer so far."""
        super().pause_writing()
        if self._timeouts.send_s > 0 and self._send_timer is None:
            self._unsent = _unsent(self.transport)
            self._send_timer = self._loop.call_later(self._timeouts.send_s, self._send_timed_out)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

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

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse, or whose handler raised, as the JSON
        error body; the connection still closes after it."""
        if self._request_count == 1 and isinstance(exc, BadHttpMethod):
            # aiohttp logs this one at DEBUG only (non-HTTP bytes, often TLS to a plain port), where
            # an operator never sees why a client got nothing it could read.
            self.log_exception("Error handling request", exc_info=exc)
        super().handle_error(request, status, exc, message)  # logs; raises once an answer began
        error: StargateError
        if isinstance(exc, LineTooLong):
            error = RequestError(f"the request line or a header field is longer than {MAX_LINE_BYTES} bytes")
        elif status < 500:
            error = RequestError(f"malformed HTTP request: {detail(message or exc or 'unparsable')}")
        elif status == 504:
            error = HandlerTimedOut("the request timed out inside the server")
        else:
            error = StargateError("internal server error")
        response = error_response(error, problem=self._problem)
        response.force_close()
        return response

    def idle_keepalive(self, for_s: float) -> bool:
        """Served a request and has waited ``for_s`` or longer for the next, none of its bytes come
        yet: closing it loses nothing, a client must expect it as at the keep-alive timeout (with
        the head deadline off, a head begun is not seen)."""
        if not (self._request_count > 0 and self._head_timer is None and self._awaiting_head()):
            return False
        idle_since = self._next_keepalive_close_time - self._keepalive_timeout
        return self._loop.time() - idle_since >= for_s

    def skip_lingering(self) -> None:
        """End the connection with the answer: aiohttp reads on for up to 10 s for the rest of a body
        left unread, even when the client will not send it."""
        self._lingering_time = 0.0

    def _awaiting_head(self) -> bool:
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _body_complete(self) -> bool:
        """A request is being handled and its body is all in: bytes arriving now start the next head."""
        current = self._current_request
        return current is not None and current.content.is_eof()

    def _receiving_body(self) -> bool:
        """The latest request's body is not all in (a head parsed but not handled yet, or the one
        being handled)."""
        if self._messages:
            return not self._messages[-1][1].is_eof()
        current = self._current_request
        return current is not None and not current.content.is_eof()

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport is None or not self._receiving_body():
            return
        limit = self._timeouts.body_s
        if self._reading_paused or self._buffer_paused or self._body_complete():
            # The server is not taking the bytes (flow control), or not yet waiting for them (a body
            # pipelined behind a request still being handled): the silence is not the client's.
            self._last_data = self._loop.time()
        quiet = self._loop.time() - self._last_data
        if quiet < limit:
            self._body_timer = self._loop.call_later(limit - quiet, self._check_body)
            return
        self._close_for(
            Fault.SLOW_BODY, "closed the connection from %s: its request body sent nothing for %d ms", limit
        )

    def _send_timed_out(self) -> None:
        """Cut a client that read nothing for the whole period. One that read some of what the
        kernel holds for it is slow, not stalled: writing resumes only once about half of several MB
        queued there drained, and a client reading 32 KB/s was cut, logged as reading nothing."""
        self._send_timer = None
        if self.transport is not None and self.writing_paused:
            unsent = _unsent(self.transport)
            if unsent is not None and self._unsent is not None and unsent < self._unsent:
                self._unsent = unsent
                self._send_timer = self._loop.call_later(self._timeouts.send_s, self._send_timed_out)
                return
            self._close_for(
                Fault.SLOW_READER,
                "closed the connection to %s: it read nothing of the answer for %d ms",
                self._timeouts.send_s,
            )

    def _close_for(self, fault: Fault, message: str, limit_s: float) -> None:
        """Reset the connection (a close would wait to flush what the client does not read). A zero
        linger makes the kernel send a RST and drop its send queue: an abort alone left the ~4 MB
        the kernel held for a stalled reader queued, then a FIN, for as long as the peer lived."""
        self.timed_out = True
        self._faults.report(fault, message, self._peer, round(limit_s * 1000))
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            self.transport.abort()

    def _arm_head_timer(self) -> None:
        if self._timeouts.head_s > 0:
            self._head_timer = self._loop.call_later(self._timeouts.head_s, self._head_timed_out)

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
            round(self._timeouts.head_s * 1000),
        )
        self.force_close()


CROWDED_SHARE = 0.8
"""Share of the process's open-file limit one listener's connections may reach before a warning."""


SHED_EVERY_S = 1.0
"""How often a crowded listener looks for idle keep-alive connections to close (each look reads
every connection)."""
SHED_IDLE_S = 2.0
"""How long a keep-alive connection must have been idle to be closed for room: a pooled client
that had just used one sent its next request on it as it closed (0.1-0.2 % of a non-retrying
client's requests failed when every idle one was closed)."""


class _GuardedServer(web.Server):
    """aiohttp's server (the protocol factory) making ``GuardedRequestHandler`` connections.

    Past the open-file limit the event loop fails to accept a connection without a word (uvloop
    logs nothing), so idle keep-alive connections held by one client turned every new client away
    for their 75 s. From ``CROWDED_SHARE`` of the limit a new connection closes the idle keep-alive
    ones (as Envoy's overload manager shortens idle timeouts) and is a (rate-limited) warning."""

    def __init__(
        self,
        base: web.Server,
        faults: ClientFaults,
        timeouts: ClientTimeouts,
        problem: bool,
        open_files: int | None,
    ) -> None:
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **base._kwargs,
        )
        self._faults = faults
        self._timeouts = timeouts
        self._problem = problem
        self._open_files = open_files
        self._crowded = 0 if open_files is None else max(1, int(open_files * CROWDED_SHARE))
        self._next_shed = -math.inf

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        if not self._crowded or len(self._connections) < self._crowded:
            return
        open_now, now = len(self._connections), self._loop.time()
        idle: list[GuardedRequestHandler] = []
        if now >= self._next_shed:
            self._next_shed = now + SHED_EVERY_S
            idle = [
                c
                for c in self._connections
                if isinstance(c, GuardedRequestHandler) and c.idle_keepalive(SHED_IDLE_S)
            ]
            for connection in idle:
                connection.force_close()
        self._faults.report(
            Fault.CROWDED,
            "%d client connections open on one listener, the open-file limit is %d (ulimit -n): "
            "closed %d idle keep-alive ones; past the limit new connections fail unlogged",
            open_now,
            self._open_files,
            len(idle),
        )

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(
            self,
            faults=self._faults,
            timeouts=self._timeouts,
            problem=self._problem,
            loop=self._loop,
            **self._kwargs,
        )


IDLE_KEEPALIVE_S = 75.0
"""How long a keep-alive connection may wait idle for its next request (nginx's default). Longer
than the idle time of a pooled client connection (aiohttp's 15 s), so a router's pool closes its
side first and never sends on a connection the server is closing."""


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are ``GuardedRequestHandler``; a handler is cancelled
    when its client hangs up (or a deadline closes the connection). ``problem``: error bodies in
    Pylon's RFC 7807 form."""

    def __init__(
        self,
        app: web.Application,
        *,
        faults: ClientFaults,
        timeouts: ClientTimeouts,
        problem: bool = False,
        open_files: int | None = None,
        **kwargs: Any,
    ) -> None:
        """``open_files``: the process's open-file limit (``open_files_limit()`` when None)."""
        kwargs.setdefault("keepalive_timeout", IDLE_KEEPALIVE_S)
        super().__init__(app, handler_cancellation=True, **kwargs)
        app.on_response_prepare.append(_close_when_answer_ends_it)
        self._faults = faults
        self._timeouts = timeouts
        self._problem = problem
        self._open_files = open_files_limit() if open_files is None else open_files

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return _GuardedServer(base, self._faults, self._timeouts, self._problem, self._open_files)


async def _close_when_answer_ends_it(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Close the connection after answers the next request could not follow on it.

    An HTTP/1.0 client has no chunked framing, so a streamed body ends with the connection (aiohttp
    kept it open for ``Connection: keep-alive`` and the client waited for an end that never came).
    A request with an ``Expect`` (``100-continue``) answered before its body arrived may never send
    it: reading on took the client's next request for that body (RFC 9110 §10.1.1).
    """
    if request.version < HttpVersion11 and not isinstance(response, web.Response):
        response.force_close()
    elif request.body_exists and not request.content.is_eof() and hdrs.EXPECT in request.headers:
        response.force_close()
        if isinstance(request.protocol, GuardedRequestHandler):
            request.protocol.skip_lingering()


def request_target(request: web.BaseRequest) -> str:
    """The path and query as the client sent them, to forward unchanged: aiohttp's ``path_qs``
    decodes the query (``?a=%2F`` became ``?a=/``). An absolute-form target falls back to it."""
    raw = request.raw_path
    return raw if raw.startswith("/") else request.path_qs


def report_client_gone(
    faults: ClientFaults, request: web.BaseRequest, request_id: str | None, *, started: bool
) -> bool:
    """When ``request``'s client has hung up, log one line naming what it abandoned; else False.

    ``started``: the response head was sent.
    """
    transport = request.transport
    if transport is not None and not transport.is_closing():
        return False
    protocol = request.protocol
    if isinstance(protocol, GuardedRequestHandler) and (protocol.timed_out or protocol.stopping):
        return True  # logged when the deadline closed it, or the drain ran out
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


def expectation_problem(request: web.BaseRequest) -> StargateError | None:
    """An ``Expect`` other than ``100-continue`` (HTTP/1.1; aiohttp's own answer was plain text)."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if request.version != HttpVersion11 or expect.lower() == "100-continue":
        return None
    return ExpectationFailed(f"unsupported Expect: {detail(expect)}")


async def send_continue(request: web.BaseRequest) -> None:
    """The interim ``100 Continue`` (what aiohttp's default expect handler writes)."""
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's head is still to come


def _unsent(transport: asyncio.BaseTransport | None) -> int | None:
    """Bytes the kernel still holds for the peer (Linux ``SIOCOUTQ``), None where it cannot say."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    outq = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ's number on Linux
    if sock is None or outq is None:
        return None
    try:
        raw = fcntl.ioctl(sock.fileno(), outq, b"\0\0\0\0")
    except OSError:
        return None
    value: int = struct.unpack("i", raw)[0]
    return value
