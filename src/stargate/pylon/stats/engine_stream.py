"""Engine stats stream consumer task (spec pylon.md §6.1-§6.2).

``auto``: fall back to OpenAI chunk usage when the endpoint answers 404/405/501 before any valid
event was ever seen (the task then ends normally); afterwards those statuses are retry reasons.
``required``: reconnect forever. Reconnect delay: 100 ms doubling to 5 s, reset only by ``wake``:
Pylon calls it once its engine answers health checks, so an engine that came up after its Pylon
is read at once, not up to 5 s later (a new Pylon published no concurrency limit meanwhile, which
a router reads as unlimited). The log says once when the stream cannot be had or is lost, and once
when it is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from stargate.pylon.config import StatsStreamMode
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.stats.hub import StatsHub
from stargate.pylon.stats.ndjson import Invalid, LineSplitter, PingEvent, StatsEvent, parse_line
from stargate.wire.client_faults import detail
from stargate.wire.http_client import failure_text
from stargate.wire.link_log import LinkLog
from stargate.wire.runner import unless_set

log = logging.getLogger("stargate.pylon.stats")
UNSUPPORTED = frozenset({404, 405, 501})
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
CONNECT_TIMEOUT_S = 5.0


class EngineStatsStream:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        url: str,
        mode: StatsStreamMode,
        hub: StatsHub,
        metrics: PylonMetrics,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        backoff_start_s: float = BACKOFF_START_S,
    ) -> None:
        self._session = session
        self._url = url
        self._mode = mode
        self._hub = hub
        self._metrics = metrics
        self._sleep = sleep
        self._backoff_start = self._backoff = backoff_start_s
        self._woken = asyncio.Event()
        self._link = LinkLog(log, "engine stats stream", f"engine at {url}")
        self.valid_event_seen = False
        self._cause = ""

    def feed_line(self, line: bytes | Invalid) -> None:
        event = line if isinstance(line, Invalid) else parse_line(line)
        if event is None:
            return
        if isinstance(event, Invalid):
            self._metrics.stream_invalid.inc(event.reason)
            return
        self.valid_event_seen = True
        if isinstance(event, PingEvent):
            self._metrics.stream_events.inc("ping")
            self._hub.on_ping(event)
        elif isinstance(event, StatsEvent):
            self._metrics.stream_events.inc("stats")
            reason = self._hub.on_engine_stats(event)
            if reason is not None:
                self._metrics.stream_invalid.inc(reason)

    async def _connect_once(self) -> str:
        """Read one connection to its end; returns the reconnect reason (or ``unsupported``)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self._session.get(
                self._url, headers={"Accept": "application/x-ndjson"}, timeout=timeout
            ) as resp:
                if resp.status in UNSUPPORTED and not self.valid_event_seen:
                    return "unsupported"
                if not 200 <= resp.status < 300:
                    return "http_status"
                self._link.connected()
                splitter = LineSplitter()
                gauge = self._metrics.stream_connected.labels(str(self._mode))
                gauge.set(1)
                try:
                    while True:
                        chunk = await resp.content.readany()
                        if not chunk:
                            return "eof"
                        for line in splitter.feed(chunk):
                            self.feed_line(line)
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
                    return "read_error"
                finally:
                    gauge.set(0)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The log names the cause: an untrusted engine certificate read as a bare connect_error.
            self._cause = failure_text(exc)
            return "connect_error"

    async def run(self) -> None:
        """Runs until fallback is enabled (``auto``) or forever; never raises on engine errors."""
        while True:
            reason = await self._connect_once()
            if reason == "unsupported":
                if self._mode is StatsStreamMode.AUTO:
                    self._hub.fallback_enabled = True
                    self._metrics.source_transitions.labels(
                        "engine_stats_stream", "openai_fallback", "unsupported"
                    ).inc()
                    log.info("engine stats stream unsupported at %s; using OpenAI chunk usage", self._url)
                    return
                reason = "http_status"
            self._metrics.stream_reconnects.labels(reason).inc()
            cause, self._cause = self._cause, ""
            self._link.failed(f"{reason}: {detail(cause)}" if cause else reason, self._backoff)
            await self._wait(self._backoff)

    def wake(self) -> None:
        """Reconnect now if waiting to, and start the delays over."""
        self._woken.set()

    async def _wait(self, seconds: float) -> None:
        if await unless_set(self._sleep(seconds), self._woken):
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
        else:
            self._woken.clear()
            self._backoff = self._backoff_start
