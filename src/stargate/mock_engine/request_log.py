"""Ground-truth request log (``--request-log FILE``): one JSON line per finished request.

Lines are queued in memory (at most ``MAX_PENDING``; beyond that they are dropped and counted)
and written by one background task in batches, so the request path never touches the file.
Times are Unix seconds (``arrival``, ``first_token``, ``finish``) and milliseconds for the
phases (``queue_wait_ms``, ``prefill_ms``).

The arrival log (``--arrival-log FILE``) is the other half for fault runs: one short line per request
as it arrives, written at once, so an engine killed with SIGKILL still leaves the name of every
request it had accepted (the request log only knows finished ones, and loses its unflushed batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

import orjson

MAX_PENDING = 100_000
FLUSH_INTERVAL_S = 0.2


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    endpoint: str
    model: str
    arrival: float
    stream: bool = False
    queue_wait_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token: float | None = None
    finish: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    emitted_tokens: int = 0
    hit: bool = False
    hit_tokens: int = 0
    evicted_entries: int = 0
    evicted_tokens: int = 0
    status: int = 200
    outcome: str = "ok"

    def to_json(self, backend_id: str) -> bytes:
        row: dict[str, Any] = {
            "request_id": self.request_id,
            "backend_id": backend_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "stream": self.stream,
            "arrival": round(self.arrival, 6),
            "queue_wait_ms": round(self.queue_wait_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "first_token": None if self.first_token is None else round(self.first_token, 6),
            "finish": None if self.finish is None else round(self.finish, 6),
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "emitted_tokens": self.emitted_tokens,
            "hit": self.hit,
            "hit_tokens": self.hit_tokens,
            "evicted_entries": self.evicted_entries,
            "evicted_tokens": self.evicted_tokens,
            "status": self.status,
            "outcome": self.outcome,
        }
        return orjson.dumps(row) + b"\n"


class RequestLog:
    def __init__(self, path: str, backend_id: str) -> None:
        self._path = path
        self.backend_id = backend_id
        self._pending: deque[RequestRecord] = deque()
        self._file: IO[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.written = 0

    async def start(self) -> None:
        self._file = open(self._path, "ab")  # noqa: SIM115 - closed in stop()
        self._task = asyncio.create_task(self._run(), name="mock-engine-request-log")

    def add(self, record: RequestRecord) -> None:
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(record)

    def flush(self) -> None:
        if self._file is None or not self._pending:
            return
        lines = [self._pending.popleft().to_json(self.backend_id) for _ in range(len(self._pending))]
        self._file.write(b"".join(lines))
        self._file.flush()
        self.written += len(lines)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


class ArrivalLog:
    """``{"request_id", "backend_id", "arrival"}`` per request, one ``write`` each (O_APPEND)."""

    def __init__(self, path: str, backend_id: str) -> None:
        self._path = path
        self.backend_id = backend_id
        self._fd: int | None = None

    def start(self) -> None:
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def add(self, request_id: str, arrival: float) -> None:
        if self._fd is None:
            return
        row = {"request_id": request_id[:256], "backend_id": self.backend_id, "arrival": round(arrival, 6)}
        os.write(self._fd, orjson.dumps(row) + b"\n")

    def stop(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
