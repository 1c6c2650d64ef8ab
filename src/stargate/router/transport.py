"""Stargate → backend transport: one narrow interface, plain HTTP/1.1 keep-alive behind it.

The original speaks QUIC tunnels; here every backend is reached at its registered
``inference_server_url`` through one process-wide ``aiohttp.ClientSession``. Another transport
(QUIC, reverse tunnels) only has to implement ``Transport``. Library errors become
``UpstreamError`` at this boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from stargate.errors import UpstreamError, UpstreamInvalid, UpstreamNotSent, UpstreamTimeout
from stargate.wire.client_faults import detail
from stargate.wire.http_client import client_session
from stargate.wire.limits import HOP_HEADER_FIELDS, MAX_RESPONSE_HEADER_FIELDS

# aiohttp adds these on its own unless told not to; a proxy must send only what the client sent.
DEFAULT_LIMIT_PER_HOST = 4096
"""Connections to one backend at once (``--proxy-max-connections-per-backend``), one per request in
flight there: as many as Pylon opens to its engine. At 1024 an engine with 3000 slots answered
every stream past 1024 with 502 (the wait for a pooled connection was the connect timeout)."""


class BackendRef(Protocol):
    """One admitted backend as the transport and the proxy need it."""

    @property
    def inference_server_id(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def cluster_id(self) -> str: ...


class UpstreamResponse(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> Iterable[tuple[str, str]]: ...
    def header(self, name: str) -> str | None: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    def complete(self) -> bool:
        """True once the whole body has been read: the relay then ends the client stream in one write."""
        ...

    def release(self) -> None: ...


class Transport(Protocol):
    async def send(
        self,
        backend: BackendRef,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterable[bytes],
    ) -> UpstreamResponse:
        """Send one attempt and return once response headers arrived.

        Raises ``UpstreamNotSent`` when the request never left (nothing executed), ``UpstreamTimeout``
        when no response headers came in time, ``UpstreamError`` for any other transport failure.
        """
        ...

    async def reconnect(self, backend: BackendRef) -> bool:
        """Re-establish connectivity to ``backend`` after a transport failure."""
        ...


def make_session(
    connect_timeout_s: float, limit_per_host: int = DEFAULT_LIMIT_PER_HOST
) -> aiohttp.ClientSession:
    """The process-wide relay session (``stargate.wire.http_client``), bounded per backend. It reads
    the header fields Pylon adds to an engine's answer at Pylon's own limit."""
    return client_session(
        connect_timeout_s=connect_timeout_s,
        limit_per_host=limit_per_host,
        relay=True,
        max_headers=MAX_RESPONSE_HEADER_FIELDS + HOP_HEADER_FIELDS,
    )


T = TypeVar("T")


class _LeftRouting(TimeoutError):
    """A backend answered nothing for a whole period and was no longer in routing."""

    def __init__(self, waited_s: float) -> None:
        super().__init__(f"{waited_s:g} s")
        self.waited_s = waited_s


SILENCE_RECHECK_S = 1.0
"""How often a body silent for a whole period is checked again while its backend is in routing."""


class _Silence:
    """Ends a body that sent nothing for a whole period while its backend is out of routing (the
    rest of a body has no deadline of its own: long generations are legitimate). One timer per
    response, not one per chunk: the relay stamps each chunk's time (``last``)."""

    __slots__ = ("_alive", "_content", "_due", "_loop", "_period", "_timer", "last")

    def __init__(self, content: aiohttp.StreamReader, period_s: float, alive: Callable[[], bool]) -> None:
        self._content = content
        self._period = period_s
        self._alive = alive
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()
        self._due = self.last + period_s
        self._timer = self._loop.call_at(self._due, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        late = now - self._due > SILENCE_RECHECK_S  # the router itself was stopped: read first
        due = self.last + self._period
        if now >= due and not late and not self._alive():
            self._content.set_exception(_LeftRouting(now - self.last))
            return
        self._due = due if now < due else now + SILENCE_RECHECK_S
        self._timer = self._loop.call_at(self._due, self._check)

    def cancel(self) -> None:
        self._timer.cancel()


class _AiohttpResponse:
    __slots__ = ("_alive", "_guard", "_period", "_resp", "_silence")

    def __init__(
        self,
        resp: aiohttp.ClientResponse,
        guard: Callable[[Awaitable[bytes]], Awaitable[bytes]],
        period_s: float,
        alive: Callable[[], bool],
    ) -> None:
        self._resp = resp
        self._guard = guard
        self._period = period_s
        self._alive = alive
        self._silence: _Silence | None = None

    @property
    def status(self) -> int:
        return self._resp.status

    @property
    def reason(self) -> str | None:
        return self._resp.reason

    @property
    def headers(self) -> Iterable[tuple[str, str]]:
        return self._resp.headers.items()

    def header(self, name: str) -> str | None:
        return self._resp.headers.get(name)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the wait for its first byte is guarded like the headers' (a
        backend that sent headers at once and then hung, and left routing, fails the attempt), and
        the rest ends once the backend, out of routing, sent nothing for a whole period
        (``_Silence``): a frozen Pylon left its client's stream open for as long as it stayed
        frozen, long after it had left routing."""
        content = self._resp.content
        try:
            first = await self._guard(content.readany())
        except _LeftRouting as exc:
            message = f"upstream sent no body byte within {exc.waited_s:g} s and left routing"
            raise UpstreamError(message) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"upstream body failed: {exc!r}") from exc
        if not first:
            return
        yield first
        silence = self._silence = _Silence(content, self._period, self._alive)
        try:
            clock = asyncio.get_running_loop().time
            async for chunk in content.iter_any():
                silence.last = clock()
                yield chunk
        except _LeftRouting as exc:
            self._resp.close()
            message = f"upstream sent nothing for {exc.waited_s:.3g} s mid-body and left routing"
            raise UpstreamError(message) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(f"upstream body failed: {exc!r}") from exc
        finally:
            silence.cancel()

    def complete(self) -> bool:
        return self._resp.content.at_eof()

    def release(self) -> None:
        if self._silence is not None:
            self._silence.cancel()
        self._resp.release()


MAX_HEADER_WAIT_S = 1800.0
"""The longest wait for response headers, or then a first body byte, from a backend that stays in
routing."""


class HttpTransport:
    """HTTP/1.1 keep-alive to each backend's registered URL.

    ``connect_timeout_s`` bounds connection establishment (``--quic-connect-timeout-ms``);
    ``request_timeout_s`` bounds the time until response headers (``--quic-request-timeout-ms``),
    and then until the body's first byte, from a backend that left routing meanwhile (``alive``
    false for its id and URL: ejected by its health probes, every model advertised INACTIVE, or
    gone, also when a new registration took its id). One still in routing gets another period each
    time, up to ``MAX_HEADER_WAIT_S``: an engine sends a non-streamed answer's headers with its end,
    and a request queued behind a saturated engine's work gets its first byte late; failing them
    over ran them twice and failed every answer longer than the period (not in the original). The
    rest of the body has no deadline while its backend stays in routing (long generations are
    legitimate); once it left, a whole period of silence ends it.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        alive: Callable[[str, str], bool] = lambda _backend_id, _url: False,
    ) -> None:
        self._session = session
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._alive = alive

    async def send(
        self,
        backend: BackendRef,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterable[bytes],
    ) -> UpstreamResponse:
        url = URL(backend.url.rstrip("/") + path_qs, encoded=True)
        backend_id = backend.inference_server_id
        alive = functools.partial(self._alive, backend_id, backend.url)  # this registration, not the id
        try:
            request = self._session.request(method, url, headers=headers, data=body, allow_redirects=False)
            resp = await self._guarded(alive, request)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, ConnectionRefusedError) as exc:
            raise UpstreamNotSent(f"could not connect to backend {backend_id}") from exc
        except TimeoutError as exc:
            waited = exc.waited_s if isinstance(exc, _LeftRouting) else self._request_timeout_s
            message = f"backend {backend_id} sent no response headers within {waited:g} s"
            raise UpstreamTimeout(message) from exc
        except aiohttp.ClientResponseError as exc:  # a response head aiohttp cannot parse
            reason = detail(exc.message)
            raise UpstreamInvalid(f"backend {backend_id} answered with an unreadable head: {reason}") from exc
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise UpstreamError(f"connection to backend {backend_id} failed before a response") from exc
        return _AiohttpResponse(resp, functools.partial(self._guarded, alive), self._request_timeout_s, alive)

    async def _guarded(self, alive: Callable[[], bool], awaitable: Awaitable[T]) -> T:
        """``awaitable``, given another ``request_timeout_s`` each time one passes while the backend
        is still in routing (``alive``), up to ``MAX_HEADER_WAIT_S``; else ``_LeftRouting``."""
        loop = asyncio.get_running_loop()
        period = self._request_timeout_s
        waited = 0.0
        timer: asyncio.TimerHandle | None = None
        try:
            async with asyncio.timeout(None) as deadline:

                def each_period() -> None:
                    nonlocal waited, timer
                    waited += period
                    if waited >= MAX_HEADER_WAIT_S or not alive():
                        deadline.reschedule(loop.time())  # give up now
                    else:
                        timer = loop.call_later(period, each_period)

                timer = loop.call_later(period, each_period)
                try:
                    return await awaitable
                finally:
                    if timer is not None:
                        timer.cancel()
        except TimeoutError as exc:
            if deadline.expired():
                raise _LeftRouting(waited) from exc
            raise

    async def reconnect(self, backend: BackendRef) -> bool:
        parts = urlsplit(backend.url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            return False
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
