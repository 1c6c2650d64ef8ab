"""Upstream health probing (spec pylon.md §3.1).

Candidates are tried in order; the first 2xx path is remembered ("resolved") and tried first by
later probes. Until one succeeds, the probe path Stargate's ``GET /health`` is rewritten to is
the first candidate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp


class HealthProber:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, paths: Sequence[str]) -> None:
        self._session = session
        self._base = base_url
        self.paths = tuple(paths)
        self._resolved: int | None = None

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
            except (TimeoutError, aiohttp.ClientError):
                continue
        return False

    async def wait_healthy(self, *, timeout_s: float, wait_ms: int, retry_s: float = 0.5) -> bool:
        """Probe until healthy, every ``retry_s``, for up to ``wait_ms`` (0 = probe once)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000.0
        while True:
            if await self.probe(timeout_s):
                return True
            if loop.time() + retry_s > deadline:
                return False
            await asyncio.sleep(retry_s)
