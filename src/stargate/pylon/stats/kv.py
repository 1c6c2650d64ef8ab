"""KV-cache occupancy polling (spec pylon.md §6.6): ``GET url`` every 1 s with a 1 s timeout."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import orjson

from stargate.pylon.stats.hub import StatsHub

log = logging.getLogger("stargate.pylon.kv")
_FIELDS = ("kv_cache_capacity_tokens", "kv_cache_used_tokens", "kv_cache_free_tokens")


def parse_kv(body: bytes) -> tuple[str, int, int, int] | None:
    """``(model, capacity, used, free)``; None when a required field is missing or not a u64."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), str):
        return None
    values = [obj.get(name) for name in _FIELDS]
    if not all(type(v) is int and v >= 0 for v in values):
        return None
    cap, used, free = (int(v) for v in values if isinstance(v, int))
    return obj["model"], cap, used, free


async def poll_once(session: aiohttp.ClientSession, url: str, hub: StatsHub, timeout_s: float = 1.0) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if not 200 <= resp.status < 300:
                log.debug("kv stats %s answered %s", url, resp.status)
                return False
            parsed = parse_kv(await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("kv stats poll failed: %s", exc)
        return False
    if parsed is None:
        return False
    return hub.on_kv(*parsed)


async def run_kv_poller(
    session: aiohttp.ClientSession,
    url: str,
    hub: StatsHub,
    *,
    interval_s: float = 1.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    while True:
        await poll_once(session, url, hub)
        await sleep(interval_s)
