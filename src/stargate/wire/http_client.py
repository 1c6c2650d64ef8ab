"""The one way a process builds its aiohttp client session (design.md "Settings that matter").

No total timeout (aiohttp's 300 s default cuts long generations) but a connect timeout; explicit
pool limits (aiohttp's default total of 100 silently queues the rest); keep-alive of 15 s, shorter
than an aiohttp server's idle timeout (Pylon's, 75 s), and 4 s to an engine; bytes passed through
untouched (no automatic decompression).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import aiohttp

from stargate.wire.limits import MAX_RESPONSE_HEADER_FIELDS

KEEPALIVE_TIMEOUT_S = 15.0
ENGINE_KEEPALIVE_S = 4.0
"""Pylon's idle connections to its engine close sooner than uvicorn's (vLLM's and SGLang's server)
5 s (``--engine-keepalive-ms``): a request sent on one the engine had just closed was lost unread,
answered 503 ``local_connect_failure`` and not retried."""
TCP_USER_TIMEOUT_S = 30.0
TCP_KEEPALIVE_IDLE_S = 10
TCP_KEEPALIVE_INTERVAL_S = 5
TCP_KEEPALIVE_PROBES = 3
RELAY_SKIPPED_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
"""A forwarding proxy adds none of these: the client's own (or none) go upstream."""


def tcp_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """A client socket that fails once the peer stops acknowledging: data unacknowledged for
    ``TCP_USER_TIMEOUT_S``, or an idle connection whose keepalive probes go unanswered. A request
    sent on a connection whose packets were dropped (a peer host gone, a firewall's lost state)
    otherwise waited for its answer as long as its backend stayed in routing, up to 30 minutes."""
    family, kind, proto, _, _ = addr_info
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", TCP_KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", TCP_KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", TCP_KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", int(TCP_USER_TIMEOUT_S * 1000)),
    ):
        if hasattr(socket, option):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    return sock


def client_session(
    *,
    connect_timeout_s: float,
    limit: int = 0,
    limit_per_host: int = 0,
    read_timeout_s: float | None = None,
    relay: bool = False,
    headers: Mapping[str, str] | None = None,
    max_headers: int = MAX_RESPONSE_HEADER_FIELDS,
    keepalive_s: float = KEEPALIVE_TIMEOUT_S,
) -> aiohttp.ClientSession:
    """``limit``/``limit_per_host``: 0 = unbounded; a request past them waits for a pooled connection,
    under its caller's own deadline (a relay's wait for response headers), and the connect timeout
    bounds only the TCP connect. ``relay``: a forwarding proxy's session (no added headers). Neither
    keeps cookies: Pylon sent one client's engine cookies on the next client's requests.

    Neither decompresses, so the other asks for no compression (``Accept-Encoding: identity``, where
    aiohttp would offer gzip): a stock vLLM or SGLang ``/metrics`` page came gzipped and unreadable.
    A request that names its own ``Accept-Encoding`` keeps it, as one naming any of ``headers``
    (sent with every request) keeps its own."""
    connector = aiohttp.TCPConnector(
        limit=limit, limit_per_host=limit_per_host, keepalive_timeout=keepalive_s, socket_factory=tcp_socket
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    if not relay:
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            headers={"Accept-Encoding": "identity", **(headers or {})},
            cookie_jar=aiohttp.DummyCookieJar(),
            max_headers=max_headers,
        )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        headers=headers,
        skip_auto_headers=RELAY_SKIPPED_HEADERS,
        max_headers=max_headers,
        cookie_jar=aiohttp.DummyCookieJar(),
    )


def failure_text(exc: BaseException) -> str:
    """What a failed request saw, short: a TLS handshake's own reason first (aiohttp's text buries
    it after the address, and a log cut to one line lost it)."""
    if isinstance(exc, aiohttp.ClientSSLError):
        return f"TLS: {getattr(exc, 'certificate_error', None) or exc.os_error}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
