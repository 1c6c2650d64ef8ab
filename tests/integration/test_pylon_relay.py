from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import io
import logging
import threading
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from support.decoding import decoding_threads
from support.pylon_fakes import FakeEngine
from support.waiting import until
from yarl import URL

from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings
from stargate.pylon.relay import ENGINE_PROBE_TIMEOUT_S, RelayTimeouts
from stargate.pylon.stats.ndjson import StatsEvent
from stargate.wire.sse import MAX_PENDING_EVENT

CHAT = orjson.dumps({"model": "llama", "messages": [], "stream": True})
HEADERS = {
    "x-request-id": "r1",
    "x-model": "llama",
    "x-input-tokens": "10",
    "content-type": "application/json",
}


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def started(engine: FakeEngine, *extra: str, read_s: float = 30.0) -> PylonApp:
    settings = parse_settings(
        [
            "--upstream-http-base-url",
            engine.url,
            "--stargate-address",
            "127.0.0.1:9",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--model-name",
            "llama",
            "--disable-bringup",
            *extra,
        ]
    )
    app = PylonApp(settings, out=io.StringIO(), relay_timeouts=RelayTimeouts(read_s=read_s))
    try:
        await app.start()
    except BaseException:
        await app.close()  # the caller's ``finally`` never sees an app that failed to start
        raise
    return app


async def test_chat_relay_streams_and_observes(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    app = await started(engine, "--engine-stats-stream", "off")
    try:
        url = URL(app.http_url + "/v1/chat/completions?next=%3Fx%3D1&a=%2F", encoded=True)
        async with client.post(url, data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            body = await resp.read()
        assert body.count(b"data:") == 5 and body.endswith(b"data: [DONE]\n\n")
        _, path_qs, sent, _ = engine.requests[-1]
        assert path_qs == "/v1/chat/completions?next=%3Fx%3D1&a=%2F"  # as the client sent it
        assert sent["x-dynamo-request-priority"] == "0" and "x-stargate-expected-queue-ms" not in sent
        assert len(app.load) == 0
        text = app.metrics.render().decode()
        assert 'pylon_requests_total{model="llama",routing_key="",status="complete"} 1.0' in text
        assert app.hub.snapshot(app.registry.current("llama")).stats_sources == ("chunk_usage",)  # type: ignore[arg-type]
        assert app.hub.counter_entries() == 0  # its usage counters ended with it
    finally:
        await app.close()


@pytest.mark.parametrize(("flags", "expected_s"), [((), 4.0), (("--engine-keepalive-ms", "1500"), 1.5)])
async def test_pylon_closes_an_idle_engine_connection_before_the_engine_does(
    engine: FakeEngine, flags: tuple[str, ...], expected_s: float
) -> None:
    """uvicorn (vLLM's and SGLang's server) closes a connection idle for 5 s: a request Pylon sent
    on one just then was lost unread, a 503 ``local_connect_failure`` not retried (11 of 320
    behind an engine closing at 1 s, sent after 1 s gaps). An engine closing sooner gets the flag."""
    app = await started(engine, "--engine-stats-stream", "off", *flags)
    try:
        for session in (app._relay_session, app._session):  # the relayed requests' and Pylon's own
            assert session is not None and session.connector is not None
            assert session.connector._keepalive_timeout == expected_s < 5.0
    finally:
        await app.close()


async def test_health_does_not_wait_behind_relayed_requests_for_a_connection(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    """With every engine connection held by relayed streams, /health queued behind them and Stargate
    took a healthy, busy backend out of routing."""
    app = await started(engine, "--engine-stats-stream", "off", "--max-engine-connections", "1")
    engine.end_gate = asyncio.Event()  # the stream holds its connection until released
    try:
        url = app.http_url + "/v1/chat/completions"
        async with client.post(url, data=CHAT, headers=HEADERS) as held:
            assert held.status == 200
            await held.content.readany()
            waiting = asyncio.ensure_future(
                client.post(url, data=CHAT, headers={**HEADERS, "x-request-id": "r2"})
            )
            async with asyncio.timeout(5), client.get(app.http_url + "/health") as health:
                assert health.status == 200
            assert engine.hits("/v1/chat/completions") == 1 and not waiting.done()  # past the limit: waits
            engine.end_gate.set()
            await held.read()
        async with await waiting as second:
            assert second.status == 200 and (await second.read()).endswith(b"data: [DONE]\n\n")
    finally:
        await app.close()


async def test_b76_queue_mismatch_rejected_before_engine(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine, "--initial-input-tps", "100", "--pylon-queue-mismatch-retry-after-ms", "125")
    try:
        gen = app.registry.current("llama")
        assert gen is not None
        app.load.track("queued", gen, 0, 100)
        headers = {**HEADERS, "x-stargate-expected-queue-ms": "0"}
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
            assert resp.status == 429
            assert resp.headers["x-stargate-retryable"] == "true"
            assert resp.headers["x-stargate-retry-reason"] == "queue_estimate_mismatch"
            assert resp.headers["x-stargate-retry-after-ms"] == "125"
            body = orjson.loads(await resp.read())
        assert body["reason"] == "queue_estimate_mismatch" and body["actual_queue_ms"] == 1000
        assert body["threshold_ms"] == 25 and body["status"] == 429
        get = app.metrics.registry.get_sample_value
        for name, ms in (("expected", 0.0), ("actual", 1000.0)):
            histogram = f"pylon_queue_admission_{name}_ms"
            assert (get(f"{histogram}_count"), get(f"{histogram}_sum")) == (1.0, ms)
        assert engine.hits("/v1/chat/completions") == 0
        assert app.load.generation_of("r1") is None
    finally:
        await app.close()


async def test_b77_admission_disabled_forwards(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    app = await started(engine, "--initial-input-tps", "100", "--pylon-queue-mismatch-retry-enabled=false")
    try:
        gen = app.registry.current("llama")
        assert gen is not None
        app.load.track("queued", gen, 0, 100)
        headers = {**HEADERS, "x-stargate-expected-queue-ms": "0"}
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        assert 'result="disabled"} 1.0' in app.metrics.render().decode()
    finally:
        await app.close()


async def test_b87_b89_b90_validation(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    app = await started(engine)
    try:
        cases = [
            (
                "/v1/chat/completions",
                {k: v for k, v in HEADERS.items() if k != "x-model"},
                CHAT,
                "missing required x-model header",
            ),
            (
                "/v1/chat/completions",
                HEADERS,
                b'{"stream": false}',
                "/v1/chat/completions requests must set stream=true",
            ),
            ("/v1/responses", HEADERS, b"{}", "/v1/responses requests must set stream=true"),
            ("/v1/embeddings", HEADERS, b"{bad", "request body must be valid JSON"),
            *(  # the engine's URL would resolve them to its chat endpoint, past the rules above
                (path, HEADERS, b'{"stream": false}', "the request path must not contain . or .. segments")
                for path in ("/v1/./chat/completions", "/v1/x/../chat/completions", "/v1/chat/completions/..")
            ),
        ]
        for path, headers, body, detail in cases:
            url = URL(app.http_url + path, encoded=True)  # sent as written, dot segments included
            async with client.post(url, data=body, headers=headers) as resp:
                assert resp.status == 400 and resp.content_type == "application/problem+json"
                problem = await resp.json(content_type=None)
                assert problem["detail"] == detail and problem["title"] == "Bad Request"
                assert problem["error"] == {
                    "message": detail,
                    "type": "invalid_request_error",
                    "code": "invalid_request",
                }
        assert engine.requests == []
        async with client.post(
            app.http_url + "/v1/embeddings", data=b'{"input":"x"}', headers=HEADERS
        ) as resp:
            assert resp.status == 200
        assert engine.hits("/v1/embeddings") == 1
    finally:
        await app.close()


async def test_a_request_with_more_header_fields_than_the_engine_takes_is_refused(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine)
    try:
        extra = {f"x-extra-{i}": "v" for i in range(113)}  # a router's 100 and 12 of its own, and more
        async with client.post(
            app.http_url + "/v1/chat/completions", data=CHAT, headers={**HEADERS, **extra}
        ) as resp:
            assert resp.status == 400 and resp.content_type == "application/problem+json"
            assert (await resp.json(content_type=None))["detail"].endswith("at most 112 are taken")
        assert engine.requests == []
    finally:
        await app.close()


async def test_b91_pending_or_unknown_model_503(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    app = await started(engine)
    try:
        app.registry.allocate("pending")
        for model in ("pending", "unknown"):
            headers = {**HEADERS, "x-model": model}
            async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
                assert resp.status == 503
                assert resp.headers["x-stargate-retry-reason"] == "model_generation_unavailable"
        assert engine.requests == []
    finally:
        await app.close()


async def test_b92_upstream_retryable_429(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    engine.chat_mode, engine.chat_status = "status", 429
    engine.chat_headers = {"x-stargate-upstream-retryable": "true", "Retry-After": "2"}
    app = await started(engine)
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 429
            assert resp.headers["x-stargate-retry-reason"] == "upstream_admission_rejected"
            assert resp.headers["x-stargate-retry-after-ms"] == "2000"
            assert "x-stargate-upstream-retryable" not in resp.headers
    finally:
        await app.close()


async def test_b94_engine_down_503(client: aiohttp.ClientSession) -> None:
    dead = FakeEngine(url="http://127.0.0.1:9")
    for flag, expected in (("false", "false"), ("true", "true")):
        app = await started(
            dead, f"--pylon-local-connect-failures-retryable={flag}", "--engine-stats-stream", "off"
        )
        try:
            async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
                assert resp.status == 503
                assert resp.headers["x-stargate-retryable"] == expected
                assert (await resp.json(content_type=None))["detail"] == "local upstream connection failed"
        finally:
            await app.close()


async def test_a_body_with_no_room_to_be_read_is_a_retryable_refusal(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine, "--engine-stats-stream", "off", "--http-body-read-timeout-ms", "200")
    try:
        assert app.relay is not None
        bodies = app.relay.bodies
        assert bodies.try_take(bodies.capacity - len(CHAT) + 1)  # room for all but one byte of it
        url = app.http_url + "/v1/chat/completions"
        async with client.post(url, data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 503
            assert resp.headers["x-stargate-retryable"] == "true"
            assert resp.headers["x-stargate-retry-reason"] == "body_buffer_full"
            assert (await resp.json(content_type=None))["error"]["code"] == "body_buffer_full"
        assert engine.requests == []
        # No length and no chunks: no body, so it needs no room and is checked at once.
        reader, writer = await asyncio.open_connection(*app.http_url.removeprefix("http://").split(":"))
        head = "".join(f"{name}: {value}\r\n" for name, value in HEADERS.items())
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n{head}\r\n".encode())
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        await writer.wait_closed()
        assert answer.startswith(b"HTTP/1.1 400 ")  # the body is no JSON; not a 503 after a wait
        bodies.give(bodies.capacity - len(CHAT) + 1)
        async with client.post(url, data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            await resp.read()
        assert bodies.used == 0 and "pylon_buffered_body_bytes 0.0" in app.metrics.render().decode()
    finally:
        await app.close()


async def test_the_metrics_listener_answers_an_unknown_path_with_the_json_error_body(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine, "--engine-stats-stream", "off")
    try:
        async with client.get(f"http://127.0.0.1:{app.metrics_port}/nope") as resp:
            assert resp.status == 404
            assert (await resp.json(content_type=None))["error"]["code"] == "not_found"
    finally:
        await app.close()


async def test_compressed_body_is_checked_decoded_and_forwarded_unchanged(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine, "--engine-stats-stream", "off")
    packed = gzip.compress(orjson.dumps({"model": "llama", "input": ["a", "b", "c"]}))
    headers = {**HEADERS, "content-encoding": "gzip"}
    try:
        async with client.post(app.http_url + "/v1/embeddings", data=packed, headers=headers) as resp:
            assert resp.status == 200
        _, _, sent, body = engine.requests[-1]
        assert body == packed and sent["content-encoding"] == "gzip"
        async with client.post(app.http_url + "/v1/embeddings", data=packed[:-8], headers=headers) as resp:
            assert resp.status == 400
            assert (await resp.json(content_type=None))["detail"] == "request body is truncated gzip data"
        async with client.post(app.http_url + "/v1/embeddings", data=b"x" * 40, headers=headers) as resp:
            assert resp.status == 400
            assert (await resp.json(content_type=None))["detail"] == "request body is not valid gzip data"
        assert len(engine.requests) == 1
    finally:
        await app.close()


async def test_compressed_body_is_checked_away_from_the_event_loop(
    engine: FakeEngine, client: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """60 KB of gzip can inflate to 60 MiB: read on the event loop it stalled every request."""
    threads = decoding_threads(monkeypatch, "stargate.pylon.relay")
    app = await started(engine, "--engine-stats-stream", "off")
    packed = gzip.compress(orjson.dumps({"model": "llama", "input": ["a"]}))
    try:
        async with client.post(
            app.http_url + "/v1/embeddings", data=packed, headers={**HEADERS, "content-encoding": "gzip"}
        ) as resp:
            assert resp.status == 200
        assert len(threads) == 1 and threads[0] != threading.get_ident()
    finally:
        await app.close()


async def test_engine_down_is_retryable_by_default(client: aiohttp.ClientSession) -> None:
    """Connection refused means nothing ran: Stargate may run the request elsewhere (docs/compat.md)."""
    app = await started(FakeEngine(url="http://127.0.0.1:9"), "--engine-stats-stream", "off")
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 503
            assert resp.headers["x-stargate-retryable"] == "true"
            assert resp.headers["x-stargate-retry-reason"] == "local_connect_failure"
        # Counted as the engine's own refusals are: before, only as a failed request. Health probes
        # are not requests: a dead engine's counted as dozens of refusals a minute.
        for _ in range(3):
            async with client.get(app.http_url + "/health") as health:
                assert health.status == 503
        labels = {"inference_server_id": "pylon", "reason": "local_connect_failure", "status": "503"}
        assert app.metrics.registry.get_sample_value("pylon_retryable_responses_total", labels) == 1
    finally:
        await app.close()


async def test_a_failed_tls_handshake_with_the_engine_is_a_prompt_retryable_refusal_naming_it(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    """Nothing reached the engine. Taken for a refused connection, the engine (up) was probed in
    plain text for half a second and the refusal answered not retryable, "local upstream connection
    failed"; Stargate's health probe through Pylon timed out on the same wait."""
    tls = FakeEngine(url=engine.url.replace("http://", "https://"))
    app = await started(tls, "--engine-stats-stream", "off")
    try:
        for path, data in (("/v1/chat/completions", CHAT), ("/health", None)):
            started_at = asyncio.get_running_loop().time()
            async with client.request(
                "GET" if data is None else "POST", app.http_url + path, data=data, headers=HEADERS
            ) as resp:
                assert (resp.status, resp.headers.get("x-stargate-retryable")) == (503, "true"), path
                problem = await resp.json(content_type=None)
            assert asyncio.get_running_loop().time() - started_at < ENGINE_PROBE_TIMEOUT_S, path
            assert problem["detail"].startswith("could not connect to the engine (TLS: "), problem
    finally:
        await app.close()


@pytest.mark.parametrize(
    ("engine_state", "expected"),
    [
        ("alive", "false"),  # drops every connection unanswered but keeps accepting them
        ("gone", "true"),  # refuses connections once the request arrived
        ("dying", "true"),  # accepts and drops the first probe, then refuses (a killed process)
    ],
)
async def test_an_unanswered_request_is_retryable_only_once_the_engine_is_gone(
    client: aiohttp.ClientSession, engine_state: str, expected: str
) -> None:
    """The engine closes the connection without answering. If it still accepts connections it may be
    running the request; if it refuses them (it was killed) nothing can be, so Stargate may retry."""
    listening: list[asyncio.Server] = []

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        chat = head.startswith(b"POST")  # the chat request, not a health probe
        if (engine_state == "gone" and chat) or (engine_state == "dying" and not chat):
            listening[0].close()
        writer.transport.abort()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    listening.append(server)
    port = server.sockets[0].getsockname()[1]
    app = await started(FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off")
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 503
            assert resp.headers["x-stargate-retryable"] == expected
            problem = await resp.json(content_type=None)
        # The code is the wire contract; the detail says what happened, not a connection failure.
        assert problem["error"]["code"] == "local_connect_failure"
        assert problem["detail"] == "the engine closed the connection without answering"
        counted = (
            app.metrics.registry.get_sample_value(name, {"inference_server_id": "pylon", **labels})
            for name, labels in (
                ("pylon_retryable_responses_total", {"reason": "local_connect_failure", "status": "503"}),
                ("pylon_nonretryable_failures_total", {"reason": "local_connect_failure"}),
            )
        )
        assert [value or 0 for value in counted] == ([1, 0] if expected == "true" else [0, 1])
    finally:
        await app.close()
        server.close()


async def _raw_engine(answer: bytes, pause_s: float = 0.0) -> asyncio.Server:
    """An engine that reads a request and writes ``answer``: each ``\\n\\n``-ended piece in two
    writes ``pause_s`` apart, then closes."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for piece in answer.split(b"|"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause_s)
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"HTTP/1.1 abc\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nx: " + b"y" * 9000 + b"\r\n\r\n",
    ],
)
async def test_an_engine_answer_that_is_not_http_is_a_refusal_not_a_crash(
    client: aiohttp.ClientSession, answer: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine read the request, so it may be running it: not retryable."""
    server = await _raw_engine(answer)
    port = server.sockets[0].getsockname()[1]
    app = await started(FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off")
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 503
            assert resp.headers["x-stargate-retryable"] == "false"
            assert (await resp.json())["detail"] == "the engine's answer is not HTTP"
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        await app.close()
        server.close()


async def test_a_stream_whose_events_arrive_in_pieces_ends_whole(client: aiohttp.ClientSession) -> None:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    events = b'data: {"choices":[{"del|ta":{"content":"a b"}}]}\n\n|data: [DO|NE]\n\n'
    server = await _raw_engine(head + b"|" + events, pause_s=0.02)
    port = server.sockets[0].getsockname()[1]
    app = await started(FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off")
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            assert await resp.read() == events.replace(b"|", b"")
        metrics = app.metrics.render().decode()
        assert 'status="complete"} 1.0' in metrics and 'status="failed"} 1.0' not in metrics
    finally:
        await app.close()
        server.close()


async def test_a_stream_cut_for_an_oversized_event_says_so_in_the_log(
    client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """The spec's 1 MiB limit on one SSE event cut the client's stream without a word in any log."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    first = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    server = await _raw_engine(head + first + b"|data: " + b"x" * 2 * MAX_PENDING_EVENT + b"\n\n")
    port = server.sockets[0].getsockname()[1]
    app = await started(FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off")
    try:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
                await resp.read()
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            f"request {HEADERS['x-request-id']}: stream cut: the engine sent an SSE event longer than "
            f"{MAX_PENDING_EVENT} bytes" == m
            for m in warned
        ), warned
    finally:
        await app.close()
        server.close()


async def test_a_tracked_answer_is_asked_of_the_engine_uncompressed(client: aiohttp.ClientSession) -> None:
    """OpenAI clients send ``Accept-Encoding: gzip, deflate``; a compressed stream would hide its
    events from Pylon, which then cut it as a stream without output."""
    heads: list[bytes] = []
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    answer += b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: [DONE]\n\n'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append((await reader.readuntil(b"\r\n\r\n")).lower())
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    app = await started(FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off")
    try:
        gzip_ok = {**HEADERS, "accept-encoding": "gzip, deflate"}
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=gzip_ok) as resp:
            assert resp.status == 200
            await resp.read()
        assert b"\r\naccept-encoding: identity\r\n" in heads[0] and b"gzip" not in heads[0]
    finally:
        await app.close()
        server.close()


async def test_an_engine_that_sends_no_answer_in_time_is_a_refusal_that_says_so(
    client: aiohttp.ClientSession,
) -> None:
    release, closed = asyncio.Event(), asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # reads the request, then answers nothing
        await release.wait()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    app = await started(
        FakeEngine(url=f"http://127.0.0.1:{port}"), "--engine-stats-stream", "off", read_s=0.2
    )
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 503
            assert resp.headers["x-stargate-retryable"] == "false"
            problem = await resp.json()
        assert problem["error"]["code"] == "local_connect_failure"
        assert problem["detail"] == "the engine sent no answer within 0.2 s"
    finally:
        release.set()
        await asyncio.wait_for(closed.wait(), 5)
        await app.close()
        server.close()


async def test_b95_read_timeout_aborts(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    engine.chat_mode = "hang"
    app = await started(engine, read_s=0.2)
    try:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
                await resp.read()
        assert 'status="failed"} 1.0' in app.metrics.render().decode()
    finally:
        await app.close()


async def test_silence_ends_a_stream_only_once_its_body_began(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    settings = parse_settings(
        ["--upstream-http-base-url", engine.url, "--stargate-address", "127.0.0.1:9", "--metrics-port", "0",
         "--metrics-host", "127.0.0.1", "--model-name", "llama", "--disable-bringup"]
    )  # fmt: skip
    timeouts = RelayTimeouts(read_s=60.0, between_s=0.1)
    app = PylonApp(settings, out=io.StringIO(), relay_timeouts=timeouts)
    try:
        await app.start()
        url = app.http_url + "/v1/chat/completions"
        engine.first_byte_delay_s = 0.3  # three times the limit between reads, before the first byte
        async with client.post(url, data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        engine.first_byte_delay_s = 0.0
        engine.chat_mode = "hang"  # a first chunk, then silence
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(10):  # far below read_s: the limit between reads ends it
                async with client.post(url, data=CHAT, headers={**HEADERS, "x-request-id": "r2"}) as resp:
                    await resp.read()
    finally:
        await app.close()


@pytest.mark.parametrize("before", [b"", b"5\r\ndata:\r\n"])
async def test_a_broken_chunked_body_ends_the_stream(client: aiohttp.ClientSession, before: bytes) -> None:
    """The engine breaks its chunked framing and closes, before the first byte or after it: the
    stream is cut within the check period, not left waiting for ``read_s``."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    server = await _raw_engine(head + b"|zz-not-hex\r\ngarbage\r\n", pause_s=0.05)
    port = server.sockets[0].getsockname()[1]
    settings = parse_settings(
        ["--upstream-http-base-url", f"http://127.0.0.1:{port}", "--stargate-address", "127.0.0.1:9",
         "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--model-name", "llama", "--disable-bringup",
         "--engine-stats-stream", "off"]
    )  # fmt: skip
    app = PylonApp(settings, out=io.StringIO(), relay_timeouts=RelayTimeouts(read_s=60.0, between_s=3.0))
    try:
        await app.start()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with asyncio.timeout(10):  # far below read_s; the check runs every between_s / 3
                async with client.post(
                    app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS
                ) as resp:
                    await resp.read()
        assert 'status="failed"} 1.0' in app.metrics.render().decode()
    finally:
        await app.close()
        server.close()


async def test_b96_eof_before_output_aborts(engine: FakeEngine, client: aiohttp.ClientSession) -> None:
    engine.chat_mode = "no_output"
    app = await started(engine)
    try:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
                await resp.read()
    finally:
        await app.close()


@pytest.mark.parametrize(
    "events",
    [
        [b'event: response.created\ndata: {"type":"response.created"}\n\n',
         b'event: response.failed\ndata: {"type":"response.failed"}\n\n'],
        [b'event: response.created\rdata: {"type":"response.created"}\r\r',
         b'event: response.output_text.delta\rdata: {"delta":"hi"}\r\r'],
    ],
)  # fmt: skip
async def test_a_stream_that_ends_as_an_answer_without_a_token_is_relayed_whole(
    engine: FakeEngine, client: aiohttp.ClientSession, events: list[bytes]
) -> None:
    """The original's rule (behaviour 96) aborts a stream that ends before any event of an answer;
    one that ends in ``response.failed``, or whose events end in CR, is an answer."""
    engine.chat_mode, engine.events = "events", events
    app = await started(engine)
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert await resp.read() == b"".join(events)
        status = "complete" if b"delta" in events[1] else "failed"  # no token: no success
        labels = {"model": "llama", "routing_key": "", "status": status}
        registry = app.metrics.registry
        await until("it ended", lambda: registry.get_sample_value("pylon_requests_total", labels) == 1)
    finally:
        await app.close()


async def test_b26_health_rewritten_to_resolved_path(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    engine.health_status = {"/health": 404, "/v1/health/ready": 200}
    app = await started(engine)
    try:
        assert await app._lifecycle._prober.probe(1.0)  # type: ignore[union-attr]
        async with client.get(URL(app.http_url + "/health?probe=%2F1", encoded=True)) as resp:
            assert resp.status == 200
        method, path, headers, _ = engine.requests[-1]
        assert (method, path) == ("GET", "/v1/health/ready?probe=%2F1")  # the query as sent
        assert "x-dynamo-request-priority" not in headers
    finally:
        await app.close()


async def test_credentials_in_the_engine_url_replace_the_clients_and_are_never_logged(
    engine: FakeEngine, client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    plain = engine.url
    engine.url = plain.replace("http://", "http://admin:s3cret%21@")
    app = await started(engine)  # the stats stream is refused: its warnings name the URL
    try:
        headers = {**HEADERS, "authorization": "Bearer sk-client"}  # as the openai SDK sends
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        async with client.get(app.http_url + "/health") as resp:
            assert resp.status == 200
        await until("the stats stream's fallback", lambda: app.hub.fallback_enabled)
    finally:
        await app.close()
    basic = "Basic " + base64.b64encode(b"admin:s3cret!").decode()
    assert [sent.getall("authorization") for _, _, sent, _ in engine.requests] == [[basic], [basic]]
    assert plain in caplog.text and "s3cret" not in caplog.text


async def test_b45_auto_falls_back_on_404(engine: FakeEngine) -> None:
    app = await started(engine)
    try:
        await until("the OpenAI fallback", lambda: app.hub.fallback_enabled)
        assert "openai_fallback" in app.metrics.render().decode()
    finally:
        await app.close()


async def test_b46_required_never_falls_back(engine: FakeEngine) -> None:
    app = await started(engine, "--engine-stats-stream", "required")
    try:
        reconnect = 'pylon_engine_stats_stream_reconnects_total{reason="http_status"}'
        await until("a counted reconnect", lambda: reconnect in app.metrics.render().decode())
        assert not app.hub.fallback_enabled
        assert 'reconnects_total{reason="http_status"}' in app.metrics.render().decode()
    finally:
        await app.close()


async def test_b79_engine_ping_limit_reaches_publication(engine: FakeEngine) -> None:
    engine.stream_status = 200
    engine.stream_lines = [b'{"v":1,"type":"ping","model":"llama","max_engine_concurrency":40}']
    app = await started(engine, "--max-engine-concurrency", "25")
    try:
        gen = app.registry.current("llama")
        assert gen is not None
        await until("the engine's limit", lambda: app.hub.snapshot(gen).max_engine_concurrency == 40)
        assert app.registration_message().models["llama"].stats.max_engine_concurrency == 40
        assert not app.hub.fallback_enabled
    finally:
        await app.close()


async def test_live_load_tracks_phases_during_stream(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    engine.chat_mode = "hang"
    app = await started(engine, read_s=0.5)
    try:
        task = asyncio.ensure_future(
            client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS)
        )
        gen = app.registry.current("llama")
        assert gen is not None
        await until("input processing", lambda: app.load.snapshot(gen).input_processing_queries > 0)
        snap = app.hub.snapshot(gen)
        assert (snap.input_processing_queries, snap.queue_size, snap.total_query_input_size) == (1, 1, 10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await app.close()


async def test_a_request_whose_client_hung_up_is_no_longer_live(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    """The engine sends no ``finished`` event for a request it was told to drop: Pylon's own end
    of it ends its counters, which otherwise counted as live for 300 s."""
    engine.chat_mode = "hang"
    engine.stream_status = 200
    app = await started(engine, "--engine-stats-stream", "required")
    try:
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=HEADERS) as resp:
            assert resp.status == 200
            assert app.hub.on_engine_stats(StatsEvent("r1", "llama", 10, 1, False)) is None
            assert app.hub.counter_entries() == 1
        await until("the request ended", lambda: len(app.load) == 0)
        assert app.hub.counter_entries() == 0
        assert app.hub.on_engine_stats(StatsEvent("r1", "llama", 10, 2, False)) is None  # a late event
        assert app.hub.counter_entries() == 0
    finally:
        await app.close()


def sample(text: str, line_prefix: str) -> float:
    """Value of the exposition line that starts with ``line_prefix`` (name plus labels)."""
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_prefix!r} in\n{text}")


async def test_12_request_timing_histograms_and_tokens_recorded_at_terminal(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    """§12: timings, token counters and the in-flight gauge of proxied requests, once per request."""
    app = await started(engine, "--engine-stats-stream", "off", read_s=0.5)
    try:
        engine.chat_mode = "hang"  # headers, then silence: the read timeout fails it without output
        url = app.http_url + "/v1/chat/completions"
        hung = asyncio.create_task(client.post(url, data=CHAT, headers=HEADERS))
        await until("the request at the engine", lambda: engine.hits("/v1/chat/completions") > 0)
        text = app.metrics.render().decode()
        assert sample(text, 'pylon_requests_inflight{model="llama"}') == 1
        assert "pylon_request_duration_seconds_count" not in text
        async with await hung as resp:
            assert resp.status == 200
            with contextlib.suppress(aiohttp.ClientError):
                await resp.read()

        engine.chat_mode = "ok"
        headers = {**HEADERS, "x-request-id": "r2"}
        async with client.post(app.http_url + "/v1/chat/completions", data=CHAT, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
        text = app.metrics.render().decode()
        ok = 'model="llama",routing_key=""'
        assert sample(text, 'pylon_requests_inflight{model="llama"}') == 0
        assert sample(text, f'pylon_requests_total{{{ok},status="complete"}}') == 1
        assert sample(text, f'pylon_requests_total{{{ok},status="failed"}}') == 1
        assert sample(text, f'pylon_request_duration_seconds_count{{{ok},status="complete"}}') == 1
        assert sample(text, f'pylon_request_duration_seconds_count{{{ok},status="failed"}}') == 1
        assert sample(text, f"pylon_request_time_to_response_headers_seconds_count{{{ok}}}") == 2
        for name in ("time_to_first_output", "time_to_first_token"):  # only the completed one had output
            assert sample(text, f"pylon_request_{name}_seconds_count{{{ok}}}") == 1, name
            assert 0 < sample(text, f"pylon_request_{name}_seconds_sum{{{ok}}}") < 5, name
        assert sample(text, f"pylon_request_input_tokens_total{{{ok}}}") == 20
        assert sample(text, f"pylon_request_output_tokens_total{{{ok}}}") == 3
        assert sample(text, f'pylon_request_stats_sources_total{{{ok},source="chunk_usage"}}') == 1
    finally:
        await app.close()


async def test_b107_embeddings_item_count_reaches_model_gauges(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine)
    try:
        body = orjson.dumps({"model": "llama", "input": [[1, 2], [3, 4], [5]]})
        async with client.post(app.http_url + "/v1/embeddings", data=body, headers=HEADERS) as resp:
            assert resp.status == 200
            await resp.read()
        app.registration_message()  # publishes the model gauges, as every heartbeat does
        text = app.metrics.render().decode()
        tps = sample(text, 'pylon_model_embedding_item_tps{model="llama"}')
        assert tps > 0 and sample(text, 'pylon_model_max_embedding_item_tps{model="llama"}') == tps
        assert tps <= 3 / 0.010  # three items over at least the 10 ms floor
    finally:
        await app.close()


async def test_relay_non_streaming_relays_json_and_counts_its_usage(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine, "--engine-stats-stream", "off", "--pylon-relay-non-streaming", "true")
    try:
        body = orjson.dumps({"model": "llama", "messages": [], "stream": False})
        async with client.post(app.http_url + "/v1/chat/completions", data=body, headers=HEADERS) as resp:
            assert resp.status == 200 and resp.content_type == "application/json"
            assert (await resp.json())["usage"]["completion_tokens"] == 1
        assert engine.hits("/v1/chat/completions") == 1
        text = app.metrics.render().decode()
        assert 'pylon_requests_total{model="llama",routing_key="",status="complete"} 1.0' in text
        assert 'pylon_request_output_tokens_total{model="llama",routing_key=""} 1.0' in text
        assert len(app.load) == 0
    finally:
        await app.close()


async def test_non_streaming_refusal_says_how_to_relay(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    app = await started(engine)
    try:
        body = orjson.dumps({"model": "llama", "messages": []})
        async with client.post(app.http_url + "/v1/chat/completions", data=body, headers=HEADERS) as resp:
            assert resp.status == 400
            assert "--pylon-relay-non-streaming" in (await resp.json(content_type=None))["hint"]
    finally:
        await app.close()


async def test_requests_sharing_a_request_id_are_each_counted_until_each_ends(
    engine: FakeEngine, client: aiohttp.ClientSession
) -> None:
    """A client may send one x-request-id on several requests at once: each holds an engine slot,
    so each counts in Pylon's load (its admission and what it publishes) until it ends itself."""
    app = await started(engine, "--engine-stats-stream", "off")
    try:
        engine.chat_mode = "hang"  # streams that stay open until the engine closes
        url = app.http_url + "/v1/chat/completions"
        streams = [asyncio.create_task(client.post(url, data=CHAT, headers=HEADERS)) for _ in range(3)]
        responses = await asyncio.gather(*streams)
        assert [r.status for r in responses] == [200, 200, 200]
        gen = app.registry.current("llama")
        assert gen is not None and len(app.load) == 3 and app.load.active_requests(gen) == 3
        responses[0].close()  # one ends: the other two still count
        await until("the first request ended", lambda: len(app.load) == 2)
        assert app.load.active_requests(gen) == 2
        for response in responses[1:]:
            response.close()
        await until("every request ended", lambda: len(app.load) == 0)
        labels = {"model": "llama", "routing_key": "", "status": "cancelled"}
        assert app.metrics.registry.get_sample_value("pylon_requests_total", labels) == 3
        assert [r[2]["x-request-id"] for r in engine.requests if r[1] == "/v1/chat/completions"] == ["r1"] * 3
    finally:
        await app.close()
