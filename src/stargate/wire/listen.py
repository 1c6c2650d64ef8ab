"""Binding an aiohttp runner to ``host:port``, the same way for every listener of every process."""

from __future__ import annotations

from aiohttp import web

BACKLOG = 4096
"""Connections the kernel may hold before the process accepts them (it caps the value at
``net.core.somaxconn``, as Go's listeners use). aiohttp's default of 128 overflowed on a router
whose event loop ran behind in a sustained burst, and clients saw connections reset."""


async def listen(runner: web.AppRunner, host: str, port: int, *, backlog: int = BACKLOG) -> int:
    """Set ``runner`` up and listen (port 0 picks a free one); returns the bound port.

    A listener that cannot bind raises the ``OSError`` after cleaning ``runner`` up, so a failed
    start leaves nothing to close.
    """
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return int(runner.addresses[0][1])
