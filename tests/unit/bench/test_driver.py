from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from stargate.bench.driver import Driver, has_content, make_session
from stargate.bench.plan import RunSpec
from stargate.bench.runner import plan_runs
from stargate.bench.workload import PlannedRequest, Workload

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n'
STOP = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


def token(text: str) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"}}]}\n\n'


@dataclass
class ModeEngine:
    """Behaviour chosen per request by the ``x-test-mode`` header; logs start/end per request id."""

    events: list[tuple[str, str, float]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers["x-request-id"]
        mode = request.headers.get("x-test-mode", "ok")
        self.events.append(("start", rid, time.monotonic()))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._respond(request, mode)
        finally:
            self.in_flight -= 1
            self.events.append(("end", rid, time.monotonic()))

    async def _respond(self, request: web.Request, mode: str) -> web.StreamResponse:
        if mode == "error":
            return web.json_response({"error": "overloaded"}, status=503)
        if mode == "slow":
            await asyncio.sleep(5)
        if mode.startswith("json"):
            answer = {"choices": [{"message": {"content": "Hi, all"}}], "usage": {"completion_tokens": 3}}
            return web.json_response(answer if mode == "json" else {"error": "half"})
        resp = web.StreamResponse(headers={
            "content-type": "text/event-stream", "x-inference-server-id": "backend-1",
            "x-stargate-cluster-id": "cluster-0", "x-mock-backend-id": "engine-0",
            "x-kv-cache-hit": "true", "x-kv-cache-reused-input-tokens": "12",
            "x-kv-cache-evicted-entries": "1", "x-kv-cache-evicted-tokens": "oops"})
        await resp.prepare(request)
        await resp.write(ROLE)
        for text in ("Hello", ",", " world"):
            await asyncio.sleep(0.005 if mode == "pause" else 0)
            await resp.write(token(text))
        if mode == "cut":
            assert request.transport is not None
            request.transport.close()
            return resp
        if mode != "no_done":
            await resp.write(STOP)
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ModeEngine, str]]:
    fake = ModeEngine()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, f"http://127.0.0.1:{port}/v1/chat/completions"
    await runner.cleanup()


def planned(index: int, *, mode: str = "ok", at_ms: float | None = 0.0, session: str | None = None,
            turn: int = 0) -> PlannedRequest:
    return PlannedRequest(
        index=index, request_id=f"req-{index}", model="m", at_ms=at_ms, session=session, turn=turn,
        input_tokens=20, output_tokens=3, routing_key=None, cache_affinity_key=f"cak-{index}",
        headers={"x-request-id": f"req-{index}", "x-model": "m", "x-input-tokens": "20",
                 "x-test-mode": mode, "content-type": "application/json"},
        body=b'{"model":"m","stream":true}', behavior_class="uniform")


def open_loop(*requests: PlannedRequest, concurrency: int = 8, timeout_s: float = 5.0,
              duration_s: float | None = None) -> Workload:
    return Workload(mode="open", requests=tuple(requests), sessions=(), max_concurrency=concurrency,
                    client_timeout_s=timeout_s, duration_s=duration_s)


async def replay(urls: list[str], workload: Workload) -> list:  # type: ignore[type-arg]
    async with make_session(workload.max_concurrency) as session:
        return await Driver(session, urls, "run-a").replay(workload)


def test_has_content_ignores_role_stop_and_empty_chunks() -> None:
    assert has_content(b'{"delta":{"content":"Hi"}}')
    assert has_content(b'{"delta":{"content": "Hi"}}')
    assert not has_content(b'{"delta":{"role":"assistant"}}')
    assert not has_content(b'{"delta":{},"finish_reason":"stop"}')
    assert not has_content(b'{"delta":{"content":""}}')
    assert not has_content(b'{"delta":{"content":null}}')


async def test_successful_stream_is_timed_and_attributed(engine: tuple[ModeEngine, str]) -> None:
    _, url = engine
    (record,) = await replay([url], open_loop(planned(0, mode="pause")))
    assert record.error_class is None and record.status == 200 and record.ok
    assert record.chunks == 3
    assert record.dispatch_s <= record.headers_s <= record.first_token_s
    assert record.first_token_s <= record.last_token_s <= record.end_s
    assert record.last_token_s - record.first_token_s >= 0.009
    assert (record.backend_id, record.cluster_id, record.engine_id) == ("backend-1", "cluster-0", "engine-0")
    assert (record.cache_hit, record.cache_hit_tokens) == (True, 12)
    assert (record.evicted_entries, record.evicted_tokens) == (1, None)
    assert (record.run, record.request_id, record.cache_affinity_key) == ("run-a", "req-0", "cak-0")


async def test_a_json_answer_is_timed_when_it_arrives_whole(engine: tuple[ModeEngine, str]) -> None:
    _, url = engine
    record, broken = await replay([url], open_loop(planned(0, mode="json"), planned(1, mode="json_broken")))
    assert record.ok and record.chunks == 3
    assert record.dispatch_s <= record.headers_s <= record.first_token_s
    assert record.first_token_s == record.last_token_s <= record.end_s
    assert broken.error_class == "stream_cut" and broken.first_token_s is None


async def test_failures_are_classified(engine: tuple[ModeEngine, str]) -> None:
    _, url = engine
    records = await replay([url], open_loop(planned(0, mode="error"), planned(1, mode="no_done"),
                                            planned(2, mode="cut"), planned(3, mode="slow"), timeout_s=0.5))
    by_index = {r.index: r for r in records}
    assert (by_index[0].status, by_index[0].error_class, by_index[0].chunks) == (503, "http_503", 0)
    assert by_index[1].error_class == "stream_cut" and by_index[1].chunks == 3
    assert by_index[2].error_class == "stream_cut" and by_index[2].status == 200
    assert by_index[3].error_class == "timeout" and by_index[3].status is None
    assert 0.4 <= by_index[3].end_s - by_index[3].dispatch_s < 3.0
    assert not any(r.ok for r in records)


async def test_connection_refused_is_a_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (record,) = await replay([f"http://127.0.0.1:{port}/v1/chat/completions"], open_loop(planned(0)))
    assert (record.status, record.error_class) == (None, "connect")


async def test_a_refused_stargate_is_skipped_for_the_next_one(engine: tuple[ModeEngine, str]) -> None:
    fake, url = engine
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    records = await replay([gone, url], open_loop(*(planned(i) for i in range(4))))
    assert [(r.ok, r.retries_seen) for r in records] == [(True, 1), (True, 0), (True, 1), (True, 0)]
    assert sorted(rid for kind, rid, _ in fake.events if kind == "start") == [f"req-{i}" for i in range(4)]
    (alone,) = await replay([gone], open_loop(planned(0)))
    assert (alone.error_class, alone.retries_seen) == ("connect", 0)


async def test_open_loop_respects_schedule_and_concurrency(engine: tuple[ModeEngine, str]) -> None:
    fake, url = engine
    requests = [planned(i, mode="pause") for i in range(6)] + [planned(6, at_ms=150.0)]
    records = await replay([url], open_loop(*requests, concurrency=2))
    assert [r.index for r in records] == list(range(7))
    assert fake.max_in_flight == 2
    assert records[6].scheduled_s == pytest.approx(0.15)
    assert records[6].dispatch_s >= 0.15
    assert max(r.dispatch_s - r.scheduled_s for r in records[:6]) > 0  # queued behind the 2 permits


async def test_duration_stops_scheduling(engine: tuple[ModeEngine, str]) -> None:
    _, url = engine
    workload = open_loop(planned(0), planned(1, at_ms=10.0), planned(2, at_ms=5000.0), duration_s=1.0)
    records = await replay([url], workload)
    assert [r.index for r in records] == [0, 1]


async def test_requests_are_spread_round_robin_over_endpoints(engine: tuple[ModeEngine, str]) -> None:
    fake, url = engine
    other = ModeEngine()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", other.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await replay([url, f"http://127.0.0.1:{port}/v1/chat/completions"],
                     open_loop(*(planned(i) for i in range(4))))
    finally:
        await runner.cleanup()
    assert sorted(rid for kind, rid, _ in fake.events if kind == "start") == ["req-0", "req-2"]
    assert sorted(rid for kind, rid, _ in other.events if kind == "start") == ["req-1", "req-3"]


async def test_closed_loop_issues_each_turn_after_the_previous_one(engine: tuple[ModeEngine, str]) -> None:
    fake, url = engine
    sessions = tuple(
        tuple(planned(s * 3 + t, mode="pause", at_ms=None, session=f"s{s}", turn=t) for t in range(3))
        for s in range(3)
    )
    workload = Workload(mode="closed", requests=tuple(r for s in sessions for r in s), sessions=sessions,
                        max_concurrency=2, client_timeout_s=5.0)
    records = await replay([url], workload)
    assert len(records) == 9 and all(r.ok for r in records)
    assert fake.max_in_flight == 2
    ends = {rid: at for kind, rid, at in fake.events if kind == "end"}
    starts = {rid: at for kind, rid, at in fake.events if kind == "start"}
    for session in sessions:
        for before, after in itertools.pairwise(session):
            assert starts[after.request_id] >= ends[before.request_id]
        turn_records = [records[r.index] for r in session]
        for before, after in itertools.pairwise(turn_records):
            assert after.dispatch_s >= before.end_s


def test_repeats_interleave_the_run_order(tmp_path: Path) -> None:
    specs = [RunSpec("a", {}, []), RunSpec("b", {}, [])]
    interleaved = plan_runs(specs, tmp_path, 3, "interleaved")
    assert [p.name for p in interleaved] == ["a #1", "b #1", "b #2", "a #2", "a #3", "b #3"]
    assert interleaved[2].run_dir == tmp_path / "run-b-r2"
    assert [p.name for p in plan_runs(specs, tmp_path, 2, "fixed")] == ["a #1", "b #1", "a #2", "b #2"]
    assert [p.run_dir.name for p in plan_runs(specs, tmp_path, 1, "fixed")] == ["run-a", "run-b"]
    shuffled = plan_runs(specs, tmp_path, 4, "randomized", seed=3)
    assert shuffled == plan_runs(specs, tmp_path, 4, "randomized", seed=3)
    assert sorted(p.name for p in shuffled) == sorted(f"{n} #{r}" for n in "ab" for r in range(1, 5))
