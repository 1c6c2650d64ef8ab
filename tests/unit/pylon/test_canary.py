"""Bringup canaries (spec pylon.md §5.3) against a real loopback HTTP server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from support.waiting import until

from stargate.pylon.canary import LATE, MAX_WORK_AHEAD_S, CanaryRunner, send_canary
from stargate.pylon.health import HealthProber
from stargate.pylon.ids import CANARY, RequestIds
from stargate.pylon.load import LiveLoad, Phase
from stargate.pylon.models import Generation, ModelRegistry, ModelStatus
from stargate.wire.clock import ManualClock

UUID = "11111111-2222-3333-4444-555555555555"


@dataclass
class Engine:
    """Chat answers ``chat_body`` with ``chat_status``; ``/health`` answers ``health_status``."""

    chat_status: int = 200
    chat_body: bytes = b'{"choices":[],"usage":{"completion_tokens":2}}'
    health_status: int = 200
    chat_delay_s: float = 0.0
    chats: list[tuple[CIMultiDict[str], Any]] = field(default_factory=list)
    health_hits: int = 0
    url: str = ""
    runner: web.AppRunner | None = None
    on_chat: Callable[[web.Request], Awaitable[web.Response]] | None = None

    async def _chat(self, request: web.Request) -> web.Response:
        self.chats.append((CIMultiDict(request.headers), orjson.loads(await request.read())))
        if self.on_chat is not None:
            return await self.on_chat(request)
        await asyncio.sleep(self.chat_delay_s)
        return web.Response(status=self.chat_status, body=self.chat_body, content_type="application/json")

    async def _health(self, _request: web.Request) -> web.Response:
        self.health_hits += 1
        return web.Response(status=self.health_status)

    async def start(self) -> Engine:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = await Engine().start()
    yield e
    assert e.runner is not None
    await e.runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def canary(session: aiohttp.ClientSession, url: str, threshold: int = 237) -> str | None:
    request_id = RequestIds(UUID).new(CANARY, 3)
    gen = Generation("llama", 3)
    return await send_canary(session, url, request_id, gen, threshold=threshold, timeout_s=2)


async def test_canary_request_shape_and_success(engine: Engine, session: aiohttp.ClientSession) -> None:
    assert await canary(session, engine.url, threshold=50) is None
    headers, body = engine.chats[-1]
    assert body == {
        "model": "llama",
        "messages": [{"role": "user", "content": "1+1="}],
        "max_tokens": 50,
        "seed": 33,
        "temperature": 0.7,
        "top_p": 1.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert headers["x-request-id"].startswith(f"canary-{UUID}-g3-")
    assert headers["x-model"] == "llama" and headers["x-input-tokens"] == "4"


async def test_b38_completion_tokens_equal_to_threshold_is_runaway(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    engine.chat_body = b'{"usage":{"completion_tokens":237}}'
    failure = await canary(session, engine.url)
    assert failure is not None and "runaway" in failure
    assert await canary(session, engine.url, threshold=238) is None  # one below the maximum passes


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (500, b'{"usage":{"completion_tokens":2}}', "HTTP 500"),
        (200, b"not json", "not JSON"),
        (200, b'{"choices":[]}', "usage.completion_tokens"),
        (200, b'{"usage":{"completion_tokens":"2"}}', "usage.completion_tokens"),
    ],
)
async def test_canary_failures(
    engine: Engine, session: aiohttp.ClientSession, status: int, body: bytes, reason: str
) -> None:
    engine.chat_status, engine.chat_body = status, body
    failure = await canary(session, engine.url)
    assert failure is not None and reason in failure


async def test_canary_transport_failure(session: aiohttp.ClientSession) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: connection refused
        failure = await canary(session, f"http://127.0.0.1:{port}")
    assert failure is not None and failure.startswith("request failed")


Rig = tuple[CanaryRunner, ModelRegistry, Generation]


def runner_for(engine: Engine, session: aiohttp.ClientSession, clock: ManualClock, interval_s: float) -> Rig:
    registry = ModelRegistry()
    gen = registry.allocate("llama")
    registry.publish(gen)
    runner = CanaryRunner(
        session=session, base_url=engine.url, ids=RequestIds(UUID), registry=registry,
        prober=HealthProber(session, engine.url, ("/health",), clock=clock), interval_s=interval_s,
        threshold=237, timeout_s=2.0, retry_s=1.0, clock=clock,
    )  # fmt: skip
    return runner, registry, gen


async def after(clock: ManualClock, seconds: float) -> None:
    """Once the loop waits on the clock, move time ``seconds`` on."""
    await clock.sleeping(1)
    clock.advance(seconds)


async def test_b39_failed_canary_inactive_until_health_and_canary_recover(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    clock = ManualClock()
    runner, registry, gen = runner_for(engine, session, clock, interval_s=5.0)

    def status() -> ModelStatus:
        return dict(registry.published())[gen]

    runner.start(gen)
    try:
        for n in (1, 2):  # one canary per interval, none before it
            await clock.sleeping(1)
            assert len(engine.chats) == n - 1
            clock.advance(5.0)
            await until(f"periodic canary {n}", lambda n=n: len(engine.chats) == n)  # type: ignore[misc]
        assert status() is ModelStatus.ACTIVE and engine.health_hits == 0  # no probes while healthy
        engine.chat_status, engine.health_status = 503, 503
        await after(clock, 5.0)
        await until("INACTIVE after a failed canary", lambda: status() is ModelStatus.INACTIVE)
        await until("a recovery health probe", lambda: engine.health_hits == 1)
        chats = len(engine.chats)
        engine.chat_status = 200  # canaries would pass now, but the engine is still unhealthy
        for hits in (2, 3):  # a probe every retry interval, and no canary while it fails
            await after(clock, 1.0)
            await until(f"health probe {hits}", lambda hits=hits: engine.health_hits == hits)  # type: ignore[misc]
        assert len(engine.chats) == chats and status() is ModelStatus.INACTIVE
        engine.health_status = 200
        await after(clock, 1.0)
        await until("ACTIVE after probe and canary pass", lambda: status() is ModelStatus.ACTIVE)
        assert len(engine.chats) == chats + 1
        for n in (2, 3):
            await after(clock, 5.0)
            await until("periodic canaries resume", lambda n=n: len(engine.chats) == chats + n)  # type: ignore[misc]
        assert status() is ModelStatus.ACTIVE
        await clock.sleeping(1)
        runner.stop(gen)
        await asyncio.sleep(0)
        assert clock.pending == 0  # the retired generation's loop is gone
        stopped = len(engine.chats)
        await clock.tick(60.0)
        assert len(engine.chats) == stopped  # a retired generation gets no more canaries
    finally:
        await runner.close()


async def test_interval_zero_disables_canaries(engine: Engine, session: aiohttp.ClientSession) -> None:
    clock = ManualClock()
    runner, _, gen = runner_for(engine, session, clock, interval_s=0)
    runner.start(gen)
    try:
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("canary-")]
        await clock.tick(60.0)
        assert engine.chats == [] and clock.pending == 0
    finally:
        await runner.close()


async def test_a_canary_waits_out_the_work_queued_ahead_of_it_before_its_timeout(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """The engine answers after 0.2 s (real time: the timeout is aiohttp's), past a 0.05 s timeout."""
    engine.chat_delay_s = 0.2
    registry = ModelRegistry()
    gen = registry.allocate("llama")

    def runner(work_ahead_s: float) -> CanaryRunner:
        return CanaryRunner(
            session=session, base_url=engine.url, ids=RequestIds(UUID), registry=registry,
            prober=HealthProber(session, engine.url, ("/health",)), interval_s=5.0, threshold=237,
            timeout_s=0.05, work_ahead=lambda _gen: work_ahead_s,
        )  # fmt: skip

    assert await runner(0.0).canary(gen) == LATE
    assert await runner(1.0).canary(gen) is None  # queued behind a second of prompt work


def test_the_oldest_wait_counts_requests_sent_and_still_without_output() -> None:
    clock = ManualClock()
    load = LiveLoad(clock=clock.monotonic)
    gen, other = Generation("llama", 1), Generation("qwen", 1)
    load.track("refused", gen, 0, 10)  # never sent to the engine
    load.track("other", other, 0, 10)
    load.sent("other")
    assert load.oldest_wait_s(gen) is None
    load.track("a", gen, 0, 45_000)
    load.sent("a")
    clock.advance(5.0)
    load.track("b", gen, 0, 10)
    load.sent("b")
    load.advance("a", Phase.INPUT_PROCESSING)  # prefilling still waits
    clock.advance(5.0)
    assert load.oldest_wait_s(gen) == 10.0
    load.advance("a", Phase.OUTPUT_GENERATION)  # its first output: no longer waiting
    assert load.oldest_wait_s(gen) == 5.0
    load.release("b")
    assert load.oldest_wait_s(gen) is None
    assert load.oldest_wait_s(other) == 10.0


Late = tuple[CanaryRunner, LiveLoad, ManualClock, Generation]


def late_canaries(engine: Engine, session: aiohttp.ClientSession) -> Late:
    """Every canary is late: the engine answers after 0.2 s (real time: the timeout is aiohttp's),
    past a 0.05 s timeout; Pylon's load and the runner read the same manual clock."""
    engine.chat_delay_s = 0.2
    clock = ManualClock()
    load = LiveLoad(clock=clock.monotonic)
    registry = ModelRegistry()
    gen = registry.allocate("llama")
    runner = CanaryRunner(
        session=session, base_url=engine.url, ids=RequestIds(UUID), registry=registry,
        prober=HealthProber(session, engine.url, ("/health",)), interval_s=5.0, threshold=237,
        timeout_s=0.05, clock=clock, waiting=load.oldest_wait_s,
    )  # fmt: skip
    return runner, load, clock, gen


def prefilling(load: LiveLoad, gen: Generation, request_id: str = "long") -> None:
    load.track(request_id, gen, 0, 45_000)
    load.sent(request_id)
    load.advance(request_id, Phase.INPUT_PROCESSING)


async def test_a_late_canary_passes_behind_a_prompt_sent_before_it_still_prefilling(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    runner, load, clock, gen = late_canaries(engine, session)
    assert await runner.canary(gen) == LATE  # nothing in the engine's hands
    prefilling(load, gen)
    clock.advance(30.0)
    assert await runner.canary(gen) is None  # no output while it prefills: queued, not failed
    load.advance("long", Phase.OUTPUT_GENERATION)
    assert await runner.canary(gen) == LATE  # answered meanwhile: it excuses nothing more


async def test_a_prompt_without_output_past_the_bound_does_not_excuse_a_late_canary(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """An engine that hangs with requests in flight is still found."""
    runner, load, clock, gen = late_canaries(engine, session)
    prefilling(load, gen)
    clock.advance(MAX_WORK_AHEAD_S)
    assert await runner.canary(gen) is None
    clock.advance(1.0)
    assert await runner.canary(gen) == LATE


async def test_a_run_of_excused_canaries_ends_at_the_bound_though_clients_send_new_requests(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    """A hung engine whose clients give up and send again always has a young request waiting:
    bounded by that request's age, it stayed in routing for as long as they did."""
    runner, load, clock, gen = late_canaries(engine, session)
    for turn in range(4):  # each client gives up after 50 s and sends a new request
        prefilling(load, gen, f"r{turn}")
        clock.advance(50.0)
        verdict = await runner.canary(gen)
        load.release(f"r{turn}")
        assert verdict == (None if turn < 3 else LATE), turn  # 120 s from the first excuse, at 50 s
    engine.chat_delay_s = 0.0
    assert await runner.canary(gen) is None  # answered: the next run starts afresh
    engine.chat_delay_s = 0.2
    prefilling(load, gen, "next")
    clock.advance(1.0)
    assert await runner.canary(gen) is None


async def test_a_request_sent_after_the_canary_does_not_excuse_it(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    runner, load, clock, gen = late_canaries(engine, session)

    async def sent_behind(request: web.Request) -> web.Response:  # the engine has the canary now
        clock.advance(1.0)
        prefilling(load, gen)
        await asyncio.sleep(engine.chat_delay_s)
        return web.Response(body=engine.chat_body, content_type="application/json")

    engine.on_chat = sent_behind
    assert await runner.canary(gen) == LATE
    assert load.oldest_wait_s(gen) == 0.0  # sent while the canary waited, before it was judged
    engine.on_chat = None
    clock.advance(1.0)
    assert await runner.canary(gen) is None  # the next canary is queued behind it


async def test_a_canary_counts_in_pylons_load_while_it_runs(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    load = LiveLoad()
    registry = ModelRegistry()
    gen = registry.allocate("llama")
    registry.publish(gen)
    seen: list[int] = []

    async def chat_seen(request: web.Request) -> web.Response:  # the load while the engine runs it
        seen.append(load.active_requests(gen))
        return web.Response(body=engine.chat_body, content_type="application/json")

    engine.on_chat = chat_seen
    runner = CanaryRunner(
        session=session, base_url=engine.url, ids=RequestIds(UUID), registry=registry,
        prober=HealthProber(session, engine.url, ("/health",)), interval_s=5.0,
        threshold=237, timeout_s=2.0, occupying=load.occupying,
    )  # fmt: skip
    assert await runner.canary(gen) is None
    assert seen == [1] and load.active_requests(gen) == 0


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in events) + b"data: [DONE]\n\n"


TOKEN = {"choices": [{"index": 0, "delta": {"content": "2"}}]}


async def streamed(
    engine: Engine,
    session: aiohttp.ClientSession,
    body: bytes,
    gap_s: float = 0.0,
    threshold: int = 237,
    timeout_s: float = 2.0,
) -> str | None:
    """A canary against an engine that streams ``body`` one event at a time, ``gap_s`` apart."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in body.split(b"\n\n")[:-1]:
            await asyncio.sleep(gap_s)
            await response.write(event + b"\n\n")
        await response.write_eof()
        return response

    engine.on_chat = stream
    request_id = RequestIds(UUID).new(CANARY, 3)
    gen = Generation("llama", 3)
    return await send_canary(session, engine.url, request_id, gen, threshold=threshold, timeout_s=timeout_s)


async def test_a_streamed_canary_reads_its_usage_or_counts_its_chunks(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    usage = {"choices": [], "usage": {"completion_tokens": 237}}
    assert (
        await streamed(engine, session, sse(TOKEN, TOKEN, {"choices": [], "usage": {"completion_tokens": 2}}))
        is None
    )
    failure = await streamed(engine, session, sse(TOKEN, usage))
    assert failure is not None and "runaway" in failure
    assert await streamed(engine, session, sse(TOKEN, TOKEN, TOKEN), threshold=4) is None  # no usage event
    failure = await streamed(engine, session, sse(*[TOKEN] * 5), threshold=4)
    assert failure is not None and "runaway" in failure
    failure = await streamed(engine, session, sse({"choices": []}))
    assert failure is not None and "no usage.completion_tokens" in failure
    failure = await streamed(engine, session, b"data: {oops\n\n")
    assert failure == "stream event is not JSON"


async def test_a_slow_engine_passes_while_its_tokens_come_and_a_stalled_one_is_late(
    engine: Engine, session: aiohttp.ClientSession
) -> None:
    # Six tokens 0.1 s apart: 0.6 s in all, past the 0.25 s timeout, which no single wait reaches.
    assert await streamed(engine, session, sse(*[TOKEN] * 6), gap_s=0.1, timeout_s=0.25) is None
    assert await streamed(engine, session, sse(TOKEN, TOKEN), gap_s=0.5, timeout_s=0.25) == LATE
