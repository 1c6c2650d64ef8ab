"""Binding an aiohttp runner to ``host:port``, the same way for every listener of every process."""

from __future__ import annotations

import ipaddress
import socket

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
    sock: socket.socket | None = None
    try:
        if _is_any_v6(host):
            sock = _dual_stack_socket(port)
            site: web.BaseSite = web.SockSite(runner, sock, backlog=backlog)
        else:
            site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
        await site.start()
    except OSError:
        if sock is not None:
            sock.close()
        await runner.cleanup()
        raise
    return int(runner.addresses[0][1])


def _dual_stack_socket(port: int) -> socket.socket:
    """``[::]:port`` taking IPv4 too, as the gRPC listeners on ``[::]`` do (and nginx's or Envoy's
    with ``ipv6only`` off): asyncio sets ``IPV6_V6ONLY`` on each IPv6 listener it creates, so the
    HTTP ports refused the IPv4 clients the gRPC ports of the same process took."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
    except OSError:
        sock.close()
        raise
    return sock


def _is_any_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) == ipaddress.IPv6Address("::")
    except ValueError:
        return False
