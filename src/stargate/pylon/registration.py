"""Registration with every Stargate replica (spec pylon.md §9, stargate.md §5.3, §5.7).

``StargateDiscovery`` watches ``WatchStargates`` on the seed and, transitively, on every
announced watch URL; a URL whose stream ends loses its routers until it reconnects, except those
another URL lists, and the last published set stays while no URL has a snapshot (a watch through a
Service moves to another replica when its replica goes away, and that must not end registrations).
The first router set is published once every desired URL delivered a snapshot, or after 5 s
with at least one router. ``RegistrationClient`` keeps one ``RegisterInferenceServer`` stream
per published router and sends the full snapshot every ``--min-update-interval-ms``, and
``--stats-update-coalesce-ms`` after a change of Pylon's own load (``notify``), so what Stargate
sees of Pylon's in-flight requests is at most that old instead of up to a heartbeat old.

Neither loop ever ends on its own: any failure (an RPC error, a message that cannot be built, a
stream the library cancels) is logged with the Stargate's address and retried after a capped,
jittered exponential backoff (first retry after 1 s as the spec says; an acked stream that ends is
reopened at once). Logs say when a Stargate becomes unreachable or reachable again, once per change.
"""

from __future__ import annotations

import asyncio
import logging
import random
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from stargate.proto import stargate_pb2, stargate_pb2_grpc
from stargate.wire import headers as h
from stargate.wire.backoff import Backoff
from stargate.wire.clock import Clock, SystemClock
from stargate.wire.http_client import failure_text
from stargate.wire.link_log import LinkLog
from stargate.wire.proto import stats_to_proto

__all__ = [
    "RegistrationClient",
    "RouterInfo",
    "StargateDiscovery",
    "bearer_token",
    "open_channel",
    "router_from_info",
    "stats_to_proto",
    "token_source",
    "with_scheme",
]

log = logging.getLogger("stargate.pylon.registration")
RETRY_S = 1.0
MAX_RETRY_S = 4.0
"""1, 2, 4, 4 ... s (plus up to 25 % jitter): a Pylon is back within 5 s of a router that restarts
after any outage, inside the 10 s in which a new router holds requests for its models."""
INITIAL_DISCOVERY_TIMEOUT_S = 5.0
T = TypeVar("T")
WATCH_SILENCE_S = 300.0
"""A discovery watch with no snapshot for this long is reopened, where Stargate does not say how
often it sends one (``watch_silence_s``)."""
WATCH_SILENCE_FLOOR_S = 300.0
ACK_TIMEOUT_FLOOR_S = 300.0
ACK_TIMEOUT_HEARTBEATS = 5
"""A registration stream with no ack for 5 heartbeats, at least five minutes, is reopened: longer
than a Stargate that still runs is likely to stall (CPU throttling, a paused VM), since a stream
reopened while Stargate stalls ends its registration on resume and the requests that waited through
the stall are answered 404 (at 15 s and at 60 s they were); longer than gateways wait for an answer."""
LATE_S = 1.0
LATE_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class RouterInfo:
    router_id: str
    authority: str
    dial_url: str


def with_scheme(url: str) -> str:
    url = url.strip()
    return url if "://" in url else "http://" + url


def router_from_info(info: stargate_pb2.StargateInfo) -> RouterInfo | None:
    """A router is known by its advertised address, whichever replica lists it: a replica lists
    itself under its ``--stargate-id`` but its peers under their addresses."""
    authority = info.advertise_addr.strip() or info.stargate_id.strip()
    if not authority:
        return None
    dial = info.grpc_pylon_dial_addr.strip() or authority
    return RouterInfo(authority, authority, with_scheme(dial))


def open_channel(url: str, authority: str | None = None) -> grpc.aio.Channel:
    """``authority``: the ``:authority`` presented in plain text (spec pylon.md §5). Over TLS gRPC
    checks the server's certificate against it, so a TLS front whose certificate names the host
    dialled, not Stargate's advertised address, refused every registration: TLS presents the host
    dialled (docs/compat.md)."""
    scheme, _, target = with_scheme(url).partition("://")
    target = target.rstrip("/")
    # A channel of its own connection: a stream reopened after its acks stopped reused, through
    # gRPC's process-wide pool, the connection that had gone silent.
    options: list[tuple[str, str | int]] = [("grpc.use_local_subchannel_pool", 1)]
    if scheme == "https":
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=options)
    if authority:
        options.append(("grpc.default_authority", authority))
    return grpc.aio.insecure_channel(target, options=options)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        details = (exc.details() or "").strip()
        return f"{exc.code().name}: {details}" if details else exc.code().name
    return failure_text(exc)


def _library_cancelled() -> bool:
    """True when a ``CancelledError`` came from the gRPC library, not from cancelling this task."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class StargateDiscovery:
    def __init__(
        self,
        seeds: list[str],
        on_change: Callable[[dict[str, RouterInfo]], None],
        *,
        retry_s: float = RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        initial_timeout_s: float = INITIAL_DISCOVERY_TIMEOUT_S,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        silence_s: float = WATCH_SILENCE_S,
    ) -> None:
        self._seeds = [with_scheme(s) for s in seeds if s.strip()]
        self._silence_s = silence_s
        if not self._seeds:
            raise ValueError("no Stargate seed address")
        self._on_change = on_change
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._initial_timeout_s = initial_timeout_s
        self._clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._snapshots: dict[str, list[RouterInfo]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._published: dict[str, RouterInfo] | None = None
        self._timed_out = False

    def _routers(self) -> dict[str, RouterInfo]:
        out: dict[str, RouterInfo] = {}
        for url in sorted(self._snapshots):
            for router in self._snapshots[url]:
                out.setdefault(router.router_id, router)
        return out

    def _maybe_publish(self) -> None:
        if not self._snapshots:
            return  # no URL answers now: the last published set stays until one does
        routers = self._routers()
        if self._published is None:
            complete = all(url in self._snapshots for url in self._tasks)
            if not (complete or (self._timed_out and routers)):
                return
        if routers != self._published:
            self._published = routers
            self._on_change(dict(routers))

    def _ensure_watch(self, url: str) -> None:
        if url not in self._tasks:
            self._tasks[url] = asyncio.get_running_loop().create_task(self._watch(url))

    async def _watch(self, url: str) -> None:
        link = LinkLog(log, "stargate discovery watch", f"Stargate at {url}")
        backoff = Backoff(self._retry_s, self._max_retry_s, rng=self._rng)
        while True:
            reason = "stream ended"
            try:
                reason = await self._watch_once(url, link, backoff)
            except asyncio.CancelledError:
                if not _library_cancelled():
                    raise
                reason = "stream cancelled"
            except Exception as exc:  # anything else is logged and retried, never the end of discovery
                reason = _describe(exc)
            if self._snapshots.pop(url, None) is not None:
                self._maybe_publish()
            delay = backoff.next_delay()
            link.failed(reason, delay)
            await self._clock.sleep(delay)

    async def _watch_once(self, url: str, link: LinkLog, backoff: Backoff) -> str:
        channel = open_channel(url)
        try:
            stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            watch = stub.WatchStargates(stargate_pb2.WatchStargatesRequest())
            async with asyncio.timeout(self._silence_s):
                metadata = await watch.initial_metadata()
            silence_s = watch_silence_s(metadata, self._silence_s)
            async for msg in each_within(watch, silence_s, "snapshot from Stargate"):
                link.connected()
                backoff.reset()
                routers = [r for info in msg.stargates if (r := router_from_info(info)) is not None]
                self._snapshots[url] = routers
                for extra in msg.watch_stargate_urls:
                    if extra.strip():
                        self._ensure_watch(with_scheme(extra))
                self._maybe_publish()
        finally:
            await channel.close()
        return "stream ended"

    async def run(self) -> None:
        for seed in self._seeds:
            self._ensure_watch(seed)
        try:
            await self._clock.sleep(self._initial_timeout_s)
            self._timed_out = True
            self._maybe_publish()
            await asyncio.Event().wait()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def watch_silence_s(metadata: Iterable[tuple[str, str | bytes]] | None, default_s: float) -> float:
    """How long a watch may send nothing: three of the heartbeats Stargate says it sends
    (``WATCH_HEARTBEAT_METADATA``), at least ``WATCH_SILENCE_FLOOR_S``; ``default_s`` where it says
    none (the original's Stargate)."""
    for key, value in metadata or ():
        if key == h.WATCH_HEARTBEAT_METADATA and isinstance(value, str) and value.isdigit():
            return max(WATCH_SILENCE_FLOOR_S, 3 * int(value[:12]) / 1000.0)
    return default_s


class Silent(Exception):
    """A stream that sent nothing for longer than it should (``each_within``): it is reopened."""


async def each_within(stream: AsyncIterable[T], timeout_s: float, what: str) -> AsyncIterator[T]:
    """``stream``'s items, each within ``timeout_s`` of the one before, else ``Silent``. A wait whose
    timer fired ``LATE_S`` past its deadline means this process was not running (SIGSTOP, a paused
    VM): what arrived meanwhile is still to be read, and gets ``LATE_GRACE_S`` (a paused Pylon tore
    its streams down on resume, blaming Stargate, with Stargate's messages unread in its buffers)."""
    items = aiter(stream)
    loop = asyncio.get_running_loop()
    while True:
        following = asyncio.ensure_future(anext(items))
        try:
            deadline = loop.time() + timeout_s
            done, _ = await asyncio.wait({following}, timeout=timeout_s)
            if not done and loop.time() - deadline > LATE_S:
                done, _ = await asyncio.wait({following}, timeout=LATE_GRACE_S)
            if not done:
                raise Silent(f"no {what} within {timeout_s:g} s")
            item = following.result()
        except StopAsyncIteration:
            return
        finally:
            if not following.done():
                following.cancel()
            # A gRPC read cancelled, or ended by the call while this wait was, ends in the call's
            # error, which asyncio logs with a traceback unless it is retrieved.
            following.add_done_callback(_retrieve)
        yield item


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class _Attempt:
    """What one stream attempt saw: whether Stargate acked, and a message that could not be built."""

    __slots__ = ("acked", "build_error", "pause")

    def __init__(self) -> None:
        self.acked = False
        self.build_error: Exception | None = None
        self.pause: asyncio.Future[None] | None = None

    def end(self) -> None:
        """Stop the message generator's wait: gRPC leaves it running after the call has ended."""
        if self.pause is not None:
            self.pause.cancel()


class RegistrationClient:
    """One registration stream per router; ``snapshot`` builds the full registration message."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], stargate_pb2.InferenceServerRegistration],
        interval_ms: int,
        token: Callable[[], str | None],
        on_connected: Callable[[str, bool], None] = lambda _router, _up: None,
        retry_s: float = RETRY_S,
        max_retry_s: float = MAX_RETRY_S,
        coalesce_ms: int = 0,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        ack_timeout_s: float | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._coalesce_s = coalesce_ms / 1000.0
        self._changed: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()
        self._interval_s = interval_ms / 1000.0
        self._interval_ms = interval_ms
        self._token = token
        self._on_connected = on_connected
        self._retry_s = retry_s
        self._max_retry_s = max_retry_s
        self._clock = clock or SystemClock()
        self._rng = rng or random.Random()
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._ack_timeout_s = ack_timeout_s or max(
            ACK_TIMEOUT_FLOOR_S, ACK_TIMEOUT_HEARTBEATS * self._interval_s
        )

    @property
    def routers(self) -> list[str]:
        return sorted(self._streams)

    def update_routers(self, routers: dict[str, RouterInfo]) -> None:
        for router_id in [r for r in self._streams if r not in routers]:
            self._streams.pop(router_id).cancel()
            # Reported here: a stream cancelled while it waits to retry would report nothing.
            self._on_connected(router_id, False)
        loop = asyncio.get_running_loop()
        for router_id, info in routers.items():
            if router_id not in self._streams:
                self._streams[router_id] = loop.create_task(self._run_router(info))

    def notify(self) -> None:
        """The snapshot changed: each stream sends it after the coalesce delay (0 = heartbeats only)."""
        if self._coalesce_s > 0:
            for changed in self._changed:
                changed.set()

    async def _pause(self, changed: asyncio.Event) -> None:
        """Until the next heartbeat, or the coalesce delay after a change, whichever comes first."""
        waits = {asyncio.ensure_future(self._clock.sleep(self._interval_s))}
        if self._coalesce_s > 0:
            waits.add(asyncio.ensure_future(self._after_change(changed)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _after_change(self, changed: asyncio.Event) -> None:
        await changed.wait()
        await self._clock.sleep(self._coalesce_s)  # later changes ride along

    async def _messages(self, attempt: _Attempt) -> AsyncIterator[stargate_pb2.InferenceServerRegistration]:
        """Snapshots every interval; one that cannot be built cancels the call, the error kept."""
        changed = asyncio.Event()
        self._changed.add(changed)
        while True:
            changed.clear()
            try:
                message = self._snapshot()
            except Exception as exc:
                attempt.build_error = exc
                log.exception("building the registration message failed; the stream is reopened")
                raise
            yield message
            attempt.pause = asyncio.ensure_future(self._pause(changed))
            await attempt.pause

    def _metadata(self) -> list[tuple[str, str]]:
        md = [(h.HEARTBEAT_METADATA, str(self._interval_ms))]
        token = self._token()
        if token:
            md.append(("authorization", f"Bearer {token}"))
        return md

    async def _run_router(self, info: RouterInfo) -> None:
        link = LinkLog(log, f"registration stream to {info.router_id}", f"Stargate at {info.dial_url}")
        backoff = Backoff(self._retry_s, self._max_retry_s, rng=self._rng)
        while True:
            attempt = _Attempt()
            reason = "stream ended"
            try:
                await self._stream_once(info, attempt, link, backoff)
            except asyncio.CancelledError:
                if not _library_cancelled():
                    raise
                reason = "stream cancelled"
            except Exception as exc:  # logged and retried: a registration must never end silently
                reason = _describe(exc)
            finally:
                self._on_connected(info.router_id, False)
            if attempt.build_error is not None:
                reason = "registration message could not be built: " + _describe(attempt.build_error)
            # An acked stream that ends is reopened at once (spec); failures back off.
            delay = 0.0 if attempt.acked and attempt.build_error is None else backoff.next_delay()
            link.failed(reason, delay)
            await self._clock.sleep(delay)

    async def _stream_once(
        self, info: RouterInfo, attempt: _Attempt, link: LinkLog, backoff: Backoff
    ) -> None:
        channel = open_channel(info.dial_url, info.authority)
        try:
            stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
            call = stub.RegisterInferenceServer(self._messages(attempt), metadata=self._metadata())
            # Stargate acks every message. A connection gone silent without a FIN or a reset (a
            # lost NAT entry) left Pylon waiting on it for ever, out of routing once Stargate's
            # idle timeout passed, and never registering again.
            async for _ack in each_within(call, self._ack_timeout_s, "ack from Stargate"):
                if not attempt.acked:
                    attempt.acked = True
                    backoff.reset()
                    link.connected()
                    self._on_connected(info.router_id, True)
        finally:
            attempt.end()
            await channel.close()

    async def close(self) -> None:
        tasks = list(self._streams.values())
        self._streams.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


TOKEN_RULE = "a bearer token is printable ASCII without spaces"


def bearer_token(raw: bytes | str) -> str | None:
    """``raw`` trimmed, if it can travel as gRPC metadata (a bearer token: printable ASCII, no
    spaces), else None. A token with a trailing newline or a non-ASCII byte made every stream fail
    (``Invalid metadata``) while Pylon said it was ready."""
    try:
        text = (raw.decode() if isinstance(raw, bytes) else raw).strip()
    except UnicodeDecodeError:
        return None
    if not text.isascii() or not text.isprintable() or " " in text:
        return None
    return text


def token_source(static: str | None, file: str | None) -> Callable[[], str | None]:
    """Static token wins; otherwise the file is re-read (trimmed) each time a stream opens."""

    def read() -> str | None:
        if static:
            return static
        if file:
            try:
                raw = Path(file).read_bytes()
            except OSError as exc:  # checked at start: it went away since
                log.warning("cannot read --auth-token-file %s (%s); registering without a token", file, exc)
                return None
            token = bearer_token(raw)
            if token is None and raw.strip():
                log.warning("--auth-token-file %s holds no usable token (%s)", file, TOKEN_RULE)
            return token or None
        return None

    return read
