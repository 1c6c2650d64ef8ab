"""RTT health probes of one registered backend (spec §1.7).

A probe is ``GET <url>/health``; success is a 2xx status with the body fully read (within a size
cap), and the RTT is the time from send to end of body. A backend without a measured RTT is not
routable; a failing probe only takes effect at the next processed update.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp

from stargate.wire import headers as h

MAX_HEALTH_BODY_BYTES = 64 * 1024


class HealthProber:
    """Background ``Ready(rtt)``/``Pending`` status of one backend plus on-demand probes."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        inference_server_id: str,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._session = session
        self._url = url.rstrip("/") + "/health"
        self._headers = {
            h.REQUEST_ID: f"stargate-health-{inference_server_id}",
            h.MODEL: "stargate-health",
            h.INPUT_TOKENS: "0",
        }
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock_ns = clock_ns
        self._task: asyncio.Task[None] | None = None
        self.rtt_ns: int | None = None
        """Latest status: the RTT of the last successful probe (``Ready``), ``None`` for ``Pending``."""

    async def probe(self) -> int | None:
        """One probe; records and returns its RTT in ns, or ``None`` on any failure."""
        started = self._clock_ns()
        try:
            async with self._session.get(self._url, headers=self._headers, timeout=self._timeout) as resp:
                received = 0
                async for chunk in resp.content.iter_any():
                    received += len(chunk)
                    if received > MAX_HEALTH_BODY_BYTES:
                        raise ValueError("health body too large")
                ok = 200 <= resp.status < 300
        except (aiohttp.ClientError, TimeoutError, ValueError):
            ok = False
        self.rtt_ns = self._clock_ns() - started if ok else None
        return self.rtt_ns

    async def rtt_for_update(self) -> int | None:
        """RTT for a registration update: the ready status if any, else one inline probe."""
        if self.rtt_ns is not None:
            return self.rtt_ns
        return await self.probe()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"health {self._url}")

    def stop(self) -> asyncio.Task[None] | None:
        """Cancel the background loop; returns the task so an owner can await its end."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.probe()


async def wait_stopped(tasks: list[asyncio.Task[None]]) -> None:
    """Await cancelled probe loops so none outlives its owner."""
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
