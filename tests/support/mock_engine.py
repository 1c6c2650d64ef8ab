"""The mock engine in-process on an ephemeral loopback port, with a client session; stopped on the way out."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp

from stargate.mock_engine import Engine, EngineConfig, TimingConfig, start_server


@contextlib.asynccontextmanager
async def running(**overrides: Any) -> AsyncIterator[tuple[str, Engine, aiohttp.ClientSession]]:
    """``overrides`` replace ``EngineConfig`` fields; ``timing`` defaults to no token delay."""
    timing = overrides.pop("timing", TimingConfig(token_delay_ms=0.0))
    engine = Engine(replace(EngineConfig(timing=timing), **overrides))
    runner, url = await start_server(engine, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            yield url, engine, session
    finally:
        await runner.cleanup()
