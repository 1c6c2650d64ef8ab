"""Upstream health probing (spec pylon.md §3.1).

Candidates are tried in order; the first 2xx path is remembered ("resolved") and tried first by
later probes. Until one succeeds, the probe path Stargate's ``GET /health`` is rewritten to is
the first candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aiohttp

from stargate.wire.client_faults import detail
from stargate.wire.clock import Clock, SystemClock
from stargate.wire.http_client import failure_text

log = logging.getLogger("stargate.pylon")
REMIND_EVERY_S = 10.0


class HealthProber:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        paths: Sequence[str],
        *,
        clock: Clock | None = None,
    ) -> None:
        self._session = session
        self._clock = clock or SystemClock()
        self._base = base_url
        self.paths = tuple(paths)
        self._resolved: int | None = None
        self.last_failure = ""
        """What the last probe that found no 2xx saw: the warning names it (a certificate the
        engine's TLS presents and Pylon does not trust said only "is --upstream-http-base-url right?")."""

    @property
    def probe_path(self) -> str:
        return self.paths[self._resolved if self._resolved is not None else 0]

    def _order(self) -> list[int]:
        order = list(range(len(self.paths)))
        if self._resolved is not None:
            order.remove(self._resolved)
            order.insert(0, self._resolved)
        return order

    async def probe(self, timeout_s: float) -> bool:
        """One pass over the candidates; True on the first 2xx."""
        for index in self._order():
            try:
                async with self._session.get(
                    self._base + self.paths[index], timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as resp:
                    await resp.read()
                    if 200 <= resp.status < 300:
                        self._resolved = index
                        return True
                    self.last_failure = f"HTTP {resp.status}"
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.last_failure = failure_text(exc)
        return False

    async def wait_healthy(self, *, timeout_s: float, wait_ms: int, retry_s: float = 0.5) -> bool:
        """Probe until healthy, every ``retry_s``, for up to ``wait_ms`` (0 = probe once).

        An engine that is not healthy is said at once and every ``REMIND_EVERY_S``, with the URLs
        tried and the flags that change them, so a wrong address does not look like a hang.
        """
        start = self._clock.monotonic()
        deadline = start + wait_ms / 1000.0
        next_note = start
        while True:
            if await self.probe(timeout_s):
                if next_note > start:
                    log.info("engine at %s is healthy", self._base)
                return True
            now = self._clock.monotonic()
            if now >= next_note:
                next_note = now + REMIND_EVERY_S
                log.warning(
                    "engine not healthy at %s (tried %s; last: %s); waiting up to %.0f s more "
                    "(--upstream-health-wait-ms); is --upstream-http-base-url right?",
                    self._base,
                    ", ".join(self.paths),
                    detail(self.last_failure),
                    max(0.0, deadline - now),
                )
            if now + retry_s > deadline:
                return False
            await self._clock.sleep(retry_s)
