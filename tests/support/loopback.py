"""An aiohttp application served on 127.0.0.1 for the length of a test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port; yields its base URL and stops it at the end."""
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
