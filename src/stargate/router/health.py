"""Active health checks of one registered backend: RTT probes (spec §1.7) and fast ejection.

A probe is ``GET <url>/health``; success is a 2xx status with the body fully read (within a size
cap) before ``timeout_s``, and the RTT is the time from send to end of body. A backend without a
measured RTT is not routable.

Ejection (in the manner of Envoy's outlier detection; the original waited for the next
registration update, which a frozen Pylon never sends): after ``unhealthy_threshold`` probes in a
row fail, ``on_eject`` takes the backend out of routing at once; the first probe that succeeds
again calls ``on_restore(rtt)``. While a backend fails, it is probed every ``recheck_s`` instead of
every ``interval_s``, so with the defaults a backend that stops answering leaves routing within
``interval + threshold x timeout + recheck`` = 2.25 s.

A probe that fails while the backend answers this router's requests (``answering``: a response
of it, not a server error, began while the probe waited) is not counted, and the next probe comes
``recheck_s`` later: a loaded engine, or a router whose event loop runs late in a burst, answers
probes late, and ejecting every busy backend at once failed each request the routers were holding.
Such a backend keeps its last RTT; one that stops answering requests stops answering while probes
wait, so it leaves routing as before. Nor is a probe that timed out while this router's own event
loop ran late (``loop_late``, from ``LoopLag``): 100 requests with 8 MB bodies arriving at once kept
the loop busy for up to a second, every backend's probe timed out together, and the router answered
half of the burst 503 while no backend was left in routing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from stargate.errors import RequestLoop
from stargate.wire import headers as h

log = logging.getLogger(__name__)

MAX_HEALTH_BODY_BYTES = 64 * 1024
STOP_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class HealthSettings:
    interval_s: float = 1.0
    """Between probes of a healthy backend (the spec's ``HEALTH_CHECK_INTERVAL``)."""
    timeout_s: float = 0.5
    """One probe, from send to the end of the body."""
    recheck_s: float = 0.25
    """Between probes once a probe failed."""
    unhealthy_threshold: int = 2
    """Consecutive failed probes that eject the backend from routing."""
    late_loop_s: float = 0.1
    """A probe that times out while this router's event loop runs this late is not counted."""


class LoopLag:
    """Whether this process's event loop ran late lately, told by a task that sleeps ``tick_s`` at a
    time: it wakes late by as long as the loop was busy with other work."""

    def __init__(
        self,
        late_s: float,
        *,
        tick_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._late_s = late_s
        self._tick_s = tick_s
        self._clock = clock
        self._sleep = sleep
        self._late_at = -math.inf
        self._due = math.inf

    def late_within(self, seconds: float) -> bool:
        """Late at some moment in the last ``seconds``, or late now (its wake-up still waits)."""
        now = self._clock()
        return now - self._late_at <= seconds or now - self._due >= self._late_s

    async def run(self) -> None:
        try:
            while True:
                self._due = self._clock() + self._tick_s
                await self._sleep(self._tick_s)
                woke = self._clock()
                if woke - self._due >= self._late_s:
                    self._late_at = woke
        finally:
            self._due = math.inf


class HealthProber:
    """Background ``Ready(rtt)``/``Pending`` status of one backend, on-demand probes, and ejection."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        inference_server_id: str,
        *,
        settings: HealthSettings | None = None,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_eject: Callable[[int], None] | None = None,
        on_restore: Callable[[int], None] | None = None,
        answering: Callable[[float], bool] | None = None,
        loop_late: Callable[[float], bool] = lambda _seconds: False,
        via: str | None = None,
    ) -> None:
        """``answering(seconds)``: whether a response of the backend began within the last
        ``seconds``; ``loop_late(seconds)``: whether this router's event loop ran late by
        ``late_loop_s`` in that time (``LoopLag.late_within``); ``via``: this router's ``Via``
        name, with which a probe that reaches this router itself fails."""
        self._session = session
        self._url = url.rstrip("/") + "/health"
        self._backend_id = inference_server_id
        self._headers = {
            h.REQUEST_ID: f"stargate-health-{inference_server_id}",
            h.MODEL: "stargate-health",
            h.INPUT_TOKENS: "0",
        }
        if via is not None:
            self._headers[h.VIA] = f"1.1 {via}"
        self._loop_seen = False
        self._stopped = False
        self._settings = settings = settings or HealthSettings()
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._clock_ns = clock_ns
        self._sleep = sleep
        self._on_eject = on_eject
        self._on_restore = on_restore
        self._answering = answering
        self._loop_late = loop_late
        self._task: asyncio.Task[None] | None = None
        self.rtt_ns: int | None = None
        """Latest status: the RTT of the last successful probe (``Ready``), ``None`` for ``Pending``."""
        self.failures = 0
        """Probes failed in a row."""
        self.last_error = ""
        """Why the last failed probe failed, for the ejection's log line."""
        self.ejected = False
        self.late = False
        """The last probe failed while the backend answered requests, or timed out while this
        router ran late (not counted in ``failures``)."""

    async def probe(self) -> int | None:
        """One probe; records and returns its RTT in ns, or ``None`` on a failure (the last RTT when
        the backend is ``answering`` requests meanwhile)."""
        started = self._clock_ns()
        ok = timed_out = False
        error = ""
        try:
            async with self._session.get(self._url, headers=self._headers, timeout=self._timeout) as resp:
                received = 0
                async for chunk in resp.content.iter_any():
                    received += len(chunk)
                    if received > MAX_HEALTH_BODY_BYTES:
                        raise ValueError("health body too large")
                ok = 200 <= resp.status < 300
                error = f"HTTP {resp.status}"
                if resp.headers.get(h.RETRY_REASON) == RequestLoop.code and not self._loop_seen:
                    self._loop_seen = True
                    log.warning(
                        "backend %s stays out of routing: its URL %s leads back to this router",
                        self._backend_id, self._url.removesuffix("/health"),
                    )  # fmt: skip
        except TimeoutError:
            timed_out = True
            error = f"no answer within {self._settings.timeout_s:g} s"
        except (aiohttp.ClientError, ValueError) as exc:
            error = str(exc) or type(exc).__name__
        waited_s = (self._clock_ns() - started) / 1e9
        self.late = not ok and (
            (self._answering is not None and self._answering(waited_s))
            or (timed_out and self._loop_late(waited_s))
        )
        if self.late:
            return self.rtt_ns
        self.rtt_ns = self._clock_ns() - started if ok else None
        if not ok:
            self.last_error = error
        self._count(self.rtt_ns)
        return self.rtt_ns

    def _count(self, rtt_ns: int | None) -> None:
        if rtt_ns is not None:
            self.failures = 0
            if self.ejected:
                self.ejected = False
                if self._on_restore is not None:
                    self._on_restore(rtt_ns)
            return
        self.failures += 1
        if not self.ejected and self.failures >= self._settings.unhealthy_threshold:
            self.ejected = True
            if self._on_eject is not None:
                self._on_eject(self.failures)

    async def rtt_for_update(self) -> int | None:
        """RTT for a registration update: the ready status if any, else one inline probe."""
        if self.rtt_ns is not None:
            return self.rtt_ns
        return await self.probe()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"health {self._url}")

    def stop(self) -> asyncio.Task[None] | None:
        """End the background loop; returns the task so an owner can await its end.

        The cancel alone is not enough: one that lands as a probe's timeout fires comes out of
        aiohttp as that timeout, and the loop went on probing a backend whose registration had
        ended, for ever, and its router never exited on SIGTERM. The loop also checks a flag."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def _run(self) -> None:
        settings = self._settings
        while not self._stopped:
            await self._sleep(settings.recheck_s if self.failures or self.late else settings.interval_s)
            if not self._stopped:
                await self.probe()


async def wait_stopped(tasks: list[asyncio.Task[None]]) -> None:
    """Await stopped probe loops so none outlives its owner; each ends within a probe timeout, and
    the wait is bounded whatever happens."""
    if tasks:
        await asyncio.wait(tasks, timeout=STOP_WAIT_S)
