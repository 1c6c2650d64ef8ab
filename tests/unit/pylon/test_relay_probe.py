"""Pylon's check whether the engine is gone (``relay.engine_gone``), against a loopback listener."""

from __future__ import annotations

import asyncio
import socket

import pytest

from stargate.pylon.relay import engine_gone


async def test_an_ipv6_engine_is_asked_with_its_host_in_brackets() -> None:
    """``Host: ::1:8000`` is no valid header: an IPv6 literal is written in brackets (RFC 3986)."""
    if not socket.has_ipv6:
        pytest.skip("needs IPv6")
    heads: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "::1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert await engine_gone(f"http://[::1]:{port}/v1/chat/completions", "/health") is False
    finally:
        server.close()
        await server.wait_closed()
    assert f"\r\nHost: [::1]:{port}\r\n".encode() in heads[0]
