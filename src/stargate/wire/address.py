"""``host:port`` text, split and joined the same way by every flag and ready line.

An IPv6 host is written in brackets (``[::1]:80``); a split returns it without them, a join adds
them back. Callers turn ``ValueError`` into their own error naming the flag.
"""

from __future__ import annotations

import ipaddress


def split_host_port(raw: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` with a port in ``0..=65535``; anything else raises ``ValueError``,
    a ``:`` in a host outside brackets too (``1.2.3.4:5:6`` is no name a resolver can answer)."""
    host, sep, port = raw.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if (
        not sep
        or not host
        or "[" in host
        or "]" in host
        or (":" in host and not bracketed)
        or not (port.isascii() and port.isdigit())
        or int(port) > 65535
    ):
        raise ValueError(f"expected HOST:PORT, got {raw!r}")
    return host, int(port)


def split_ip_port(raw: str) -> tuple[str, int]:
    """``split_host_port`` whose host must be an IP address (a listener's bind address)."""
    host, port = split_host_port(raw)
    ipaddress.ip_address(host)
    return host, port


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def is_dialable(address: str) -> bool:
    """``host:port`` a peer can dial: a name or an IP, port 1-65535, nothing a dialer reads as more."""
    try:
        host, port = split_host_port(address)
    except ValueError:
        return False
    return port > 0 and not any(c.isspace() or c in "/?#@" for c in host)


def dial_url(raw: str) -> str:
    """``host:port`` or ``http(s)://host:port`` (https = TLS) a gRPC channel dials, with the scheme
    lower-cased (RFC 3986) when one is given; anything else raises ``ValueError``: gRPC takes a port
    above 65535 modulo 65536 and retries a target it cannot resolve for ever."""
    address = raw.strip()
    scheme, sep, target = address.partition("://")
    if not sep:
        scheme, target = "http", address
    if scheme.lower() not in ("http", "https") or not is_dialable(target.rstrip("/")):
        raise ValueError(f"expected HOST:PORT or http(s)://HOST:PORT with a port of 1-65535, got {raw!r}")
    return f"{scheme.lower()}://{target}" if sep else target


def unbracket(host: str) -> str:
    """A bare host flag's value, ``[v6]`` read as ``v6`` (the form every ``host:port`` flag takes)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
