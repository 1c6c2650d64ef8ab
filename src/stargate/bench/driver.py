"""Replay driver: sends a planned workload to one or more HTTP endpoints and records every request.

Open loop: a scheduler releases each request at its ``at_ms`` offset; released requests then wait for
one of ``max_concurrency`` permits (waiting requests hold no permit, as in the original driver), so the
gap between ``scheduled_s`` and ``dispatch_s`` is the client-side schedule lag. Closed loop:
``max_concurrency`` workers each take whole sessions and issue turn k+1 only after turn k finished.
Requests are spread over the endpoints round-robin by request index (deterministic across runs).
With a ``duration_s`` the driver starts no request after that many seconds (open loop: none scheduled
at or after it; closed loop: no new turn), lets the ones in flight finish, and records only the
requests it sent. A closed-loop turn waits its ``think_ms`` after the previous turn ended.

All times in a ``RequestRecord`` are seconds from the start of the replay on the injected clock.
``first_token_s``/``last_token_s`` are the first and last content chunks (a non-streamed JSON answer,
``client.stream: false``: both the moment it arrived whole); ``end_s`` is the instant the
response ended: the end of the body on success, or the moment the request failed (so TTLT of a
failure is its time to error, as in the original harness).
The driver never retries; the client timeout covers the whole request (connect through last byte).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from stargate.bench.score import RequestRecord
from stargate.bench.workload import PlannedRequest, Workload
from stargate.wire import headers as h
from stargate.wire.http_client import client_session

Clock = Callable[[], float]
RecordSink = Callable[[RequestRecord], None]

_ERROR_BODY_LIMIT = 64 * 1024


def has_content(payload: bytes) -> bool:
    """True when an SSE ``data:`` payload carries a non-empty ``delta.content`` string."""
    pos = payload.find(b'"content":')
    while pos >= 0:
        rest = payload[pos + 10 :].lstrip()
        if rest[:1] == b'"' and rest[1:2] != b'"':
            return True
        pos = payload.find(b'"content":', pos + 10)
    return False


def answer_tokens(body: bytes) -> int:
    """Output tokens of a non-streamed answer (``client.stream: false``): its usage, else 1 when it
    has a choice; 0 when the body is not a whole answer."""
    try:
        answer = orjson.loads(body)
        choices, usage = answer["choices"], answer.get("usage")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return 0
    if not isinstance(choices, list) or not choices:
        return 0
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 1


def _int_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


def _bool_header(value: str | None) -> bool | None:
    if value is None:
        return None
    lowered = value.strip().lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    return None


@dataclass(slots=True)
class _Attempt:
    headers_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    status: int | None
    error: str | None
    chunks: int
    got: dict[str, str]


class Driver:
    """Replays one workload against ``urls`` (full POST URLs) with one shared client session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: Sequence[str],
        run: str,
        *,
        clock: Clock = time.perf_counter,
        on_record: RecordSink | None = None,
    ) -> None:
        if not urls:
            raise ValueError("the driver needs at least one endpoint URL")
        self._session = session
        self._urls = list(urls)
        self._run = run
        self._clock = clock
        self._on_record = on_record
        self._start = 0.0
        self.records: list[RequestRecord] = []  # every finished request so far, also after a cancel

    def _now(self) -> float:
        return self._clock() - self._start

    async def replay(self, workload: Workload) -> list[RequestRecord]:
        """Every planned request's record, sorted by request index."""
        self._start = self._clock()
        if workload.mode == "closed":
            records = await self._closed_loop(workload)
        else:
            records = await self._open_loop(workload)
        return sorted(records, key=lambda r: r.index)

    async def _open_loop(self, workload: Workload) -> list[RequestRecord]:
        permits = asyncio.Semaphore(max(1, workload.max_concurrency))
        records: list[RequestRecord] = []

        async def one(req: PlannedRequest, scheduled_s: float) -> None:
            async with permits:
                records.append(await self.send(req, scheduled_s, workload.client_timeout_s))

        tasks: list[asyncio.Task[None]] = []
        try:
            for req in workload.requests:
                scheduled_s = (req.at_ms or 0.0) / 1000.0
                if workload.duration_s is not None and scheduled_s >= workload.duration_s:
                    break
                delay = scheduled_s - self._now()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req, scheduled_s)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return records

    async def _closed_loop(self, workload: Workload) -> list[RequestRecord]:
        pending: asyncio.Queue[tuple[PlannedRequest, ...]] = asyncio.Queue()
        for session_turns in workload.sessions:
            pending.put_nowait(session_turns)
        records: list[RequestRecord] = []

        async def worker() -> None:
            while True:
                try:
                    turns = pending.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for req in turns:
                    if req.think_ms > 0:
                        await asyncio.sleep(req.think_ms / 1000.0)
                    if workload.duration_s is not None and self._now() >= workload.duration_s:
                        return
                    records.append(await self.send(req, self._now(), workload.client_timeout_s))

        workers = [asyncio.create_task(worker()) for _ in range(max(1, workload.max_concurrency))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        return records

    async def send(self, req: PlannedRequest, scheduled_s: float, timeout_s: float) -> RequestRecord:
        """Send one request and classify its outcome; never raises for a request failure.

        With several Stargates, a request whose connection failed before any answer (refused, or
        closed before response headers: a replica went away) is sent again to the next one, as a
        client behind a Service would; ``retries_seen`` counts those resends.
        """
        dispatch_s = self._now()
        deadline = self._clock() + timeout_s
        retries = 0
        while True:
            url = self._urls[(req.index + retries) % len(self._urls)]
            attempt = await self._attempt(url, req, max(0.0, deadline - self._clock()))
            if attempt.error not in ("connect", "disconnected") or retries + 1 >= len(self._urls):
                break
            retries += 1
        record = RequestRecord(
            index=req.index,
            request_id=req.request_id,
            run=self._run,
            scheduled_s=scheduled_s,
            dispatch_s=dispatch_s,
            headers_s=attempt.headers_s,
            first_token_s=attempt.first_token_s,
            last_token_s=attempt.last_token_s,
            status=attempt.status,
            error_class=attempt.error,
            backend_id=attempt.got.get(h.INFERENCE_SERVER_ID),
            cluster_id=attempt.got.get(h.CLUSTER_ID),
            engine_id=attempt.got.get(h.MOCK_BACKEND_ID),
            cache_hit=_bool_header(attempt.got.get(h.KV_CACHE_HIT)),
            cache_hit_tokens=_int_header(attempt.got.get(h.KV_CACHE_REUSED_INPUT_TOKENS)),
            input_tokens=req.input_tokens,
            output_tokens=req.output_tokens,
            chunks=attempt.chunks,
            retries_seen=retries,
            end_s=self._now(),
            cache_affinity_key=req.cache_affinity_key,
            session=req.session,
            evicted_entries=_int_header(attempt.got.get(h.KV_CACHE_EVICTED_ENTRIES)),
            evicted_tokens=_int_header(attempt.got.get(h.KV_CACHE_EVICTED_TOKENS)),
        )
        self.records.append(record)
        if self._on_record is not None:
            self._on_record(record)
        return record

    async def _attempt(self, url: str, req: PlannedRequest, timeout_s: float) -> _Attempt:
        headers_s: float | None = None
        first_token_s: float | None = None
        last_token_s: float | None = None
        status: int | None = None
        error: str | None = None
        chunks = 0
        got: dict[str, str] = {}
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session.post(url, data=req.body, headers=req.headers) as resp:
                    headers_s = self._now()
                    status = resp.status
                    got = {k.lower(): v for k, v in resp.headers.items()}
                    if status != 200:
                        await resp.content.read(_ERROR_BODY_LIMIT)
                        error = f"http_{status}"
                    elif resp.content_type == "application/json":
                        chunks = answer_tokens(await resp.read())
                        if chunks:
                            first_token_s = last_token_s = self._now()
                        else:
                            error = "stream_cut"
                    else:
                        done = False
                        async for line in resp.content:
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                done = True
                            elif has_content(payload):
                                chunks += 1
                                last_token_s = self._now()
                                if first_token_s is None:
                                    first_token_s = last_token_s
                        if not done:
                            error = "stream_cut"
        except TimeoutError:
            error = "timeout"
        except aiohttp.ClientConnectorError:
            error = "connect"
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
            error = "stream_cut" if status is not None else "disconnected"
        except aiohttp.ClientOSError:  # e.g. reset while sending: the replica went away
            error = "stream_cut" if status is not None else "disconnected"
        except (aiohttp.ClientError, ValueError):
            error = "client_error"
        except OSError:
            error = "connect" if status is None else "stream_cut"
        return _Attempt(headers_s, first_token_s, last_token_s, status, error, chunks, got)


def make_session(concurrency: int, connect_timeout_s: float = 10.0) -> aiohttp.ClientSession:
    """The one client session of a replay: pool above the concurrency, no total timeout, raw bytes."""
    return client_session(connect_timeout_s=connect_timeout_s, limit=max(100, concurrency * 2))
