"""Measure the mock engine's cost: server CPU time per streamed request and requests/s.

``python -m stargate.mock_engine.perf [--requests N] [--concurrency C] [--tokens T]`` starts a
mock engine subprocess on loopback (``--token-delay-ms 0`` unless given), drives it
with an aiohttp client, and reads the server's user+system CPU time from ``/proc/<pid>/stat``
before and after. ``--url URL --pid PID`` measures an already running server instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from stargate.wire import headers as h
from stargate.wire.http_client import client_session

from .cli import LISTEN_LINE


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, pid: int, requests: int, concurrency: int, tokens: int) -> tuple[float, float]:
    """Send ``requests`` streaming chats, ``concurrency`` at a time, after a warm-up round.

    Returns (wall seconds, server CPU seconds) of the measured part.
    """
    body = {"model": "perf", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {h.OUTPUT_TOKENS: str(tokens), h.INPUT_TOKENS: "16"}
    remaining = concurrency  # warm-up: open the connections before measuring

    async with client_session(connect_timeout_s=5, limit=concurrency, read_timeout_s=30) as session:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
                    resp.raise_for_status()
                    async for _ in resp.content.iter_any():
                        pass

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        remaining = requests
        cpu_start = cpu_seconds(pid)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, cpu_seconds(pid) - cpu_start


def _spawn(tokens: int, token_delay_ms: float) -> tuple[subprocess.Popen[str], str]:
    command = [
        sys.executable, "-m", "stargate.mock_engine.cli", "--port", "0",
        "--token-delay-ms", str(token_delay_ms), "--num-tokens", str(tokens), "--log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith(LISTEN_LINE):
        process.kill()
        raise SystemExit(f"mock engine did not start: {line!r}")
    return process, line[len(LISTEN_LINE) :].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stargate.mock_engine.perf")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="for the spawned server")
    parser.add_argument("--url", help="measure a running server (needs --pid)")
    parser.add_argument("--pid", type=int)
    args = parser.parse_args(argv)
    if (args.url is None) != (args.pid is None):
        parser.error("--url and --pid go together")
    process = None
    if args.url is None:
        process, url = _spawn(args.tokens, args.token_delay_ms)
        pid = process.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        wall, cpu = asyncio.run(drive(url, pid, args.requests, args.concurrency, args.tokens))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=10)
    per_request_ms = cpu / args.requests * 1000.0
    print(
        f"{args.requests} streamed requests x {args.tokens} tokens, concurrency {args.concurrency}: "
        f"server CPU {per_request_ms:.3f} ms/request, {args.requests / wall:.0f} req/s wall, "
        f"{args.requests / cpu:.0f} req/s per server CPU-second"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
