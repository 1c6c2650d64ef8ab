"""The proxy end to end: a real Stargate on loopback, real gRPC registrations, tiny aiohttp backends.

Conformance 98, 101-114, 116-127 (HTTP proxy contract) and the real routing wait of 121.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from grpc import aio
from openai import AsyncOpenAI
from support.decoding import decoding_threads
from support.stargate_harness import (
    CHAT,
    HEADERS,
    MODEL,
    SSE_CHUNKS,
    Harness,
    Reply,
    ScriptedBackend,
    registration,
    rejection,
    running,
)
from support.waiting import until, value_of

from stargate.balancer.config import parse_lb_config
from stargate.balancer.types import Target
from stargate.proto import stargate_pb2 as pb
from stargate.router.attempt import RetrySettings
from stargate.router.health import HealthSettings
from stargate.router.plain_client import PlainClientSettings, body_key
from stargate.router.proxy import ProxySettings
from stargate.router.state import SERVER_ERRORS_IN_A_ROW


@pytest.fixture
async def sg() -> AsyncIterator[Harness]:
    async with running() as harness:
        yield harness


def labels(**kw: str) -> dict[str, str]:
    return {"routing_key": "", "model": MODEL, **kw}


# ---- header contract ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, "/v1/responses", "/v1/embeddings"])
@pytest.mark.parametrize("missing", ["x-model", "x-request-id", "x-input-tokens"])
async def test_p98_missing_required_header_is_400_and_backend_not_called(
    sg: Harness, path: str, missing: str
) -> None:
    backend = await sg.backend("b1")
    headers = {k: v for k, v in HEADERS.items() if k != missing}
    async with sg.http.post(sg.base + path, headers=headers, data=b"{}") as resp:
        assert resp.status == 400
        body = orjson.loads(await resp.read())
    assert body["error"]["code"] == "invalid_request" and missing in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert backend.requests == []
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="", status="400")) == 0


async def test_a_refused_expectation_carries_the_request_id(sg: Harness) -> None:
    status, headers, _ = await sg.post({"expect": "foo"})
    assert (status, headers["x-request-id"]) == (417, "req-1")
    status, headers, _ = await sg.post({f"x-extra-{i}": "v" for i in range(100)})
    assert (status, headers["x-request-id"]) == (400, "req-1")


async def test_p99_invalid_numeric_headers_are_400(sg: Harness) -> None:
    for name, value in [
        ("x-input-tokens", "bad"),
        ("x-max-wait-ms", "-1"),
        ("x-request-slo-ms", "1.5"),
        ("x-priority", "4294967296"),
        ("x-routing-method", "sticky"),
    ]:
        status, headers, _ = await sg.post({name: value})
        assert status == 400, name
        assert headers["x-request-id"] == "req-1", name  # every answer carries the client's id


async def test_p101_unknown_model_is_404_no_eligible_candidates(sg: Harness) -> None:
    status, headers, body = await sg.post({"x-model": "nobody"})
    assert status == 404
    assert headers["x-stargate-error-code"] == "no_eligible_candidates"
    assert headers["content-type"].startswith("application/json")
    assert orjson.loads(body) == {"error": "no eligible candidates", "code": "no_eligible_candidates"}
    series = {"routing_key": "", "model": "nobody", "inference_server_id": "", "status": "404"}
    assert sg.metric("stargate_requests_total", **series) == 1


async def test_p123_keyed_request_does_not_see_unkeyed_backend(sg: Harness) -> None:
    await sg.backend("b1")
    status, headers, _ = await sg.post({"x-routing-key": "rk-x"})
    assert (status, headers.get("x-stargate-error-code")) == (404, "no_eligible_candidates")
    assert (await sg.post({"x-routing-key": "  "}))[0] == 200


# ---- forwarding --------------------------------------------------------------------------------


async def test_p102_p103_p104_p105_headers_both_ways_and_body_passthrough(sg: Harness) -> None:
    backend = await sg.backend("b1", cluster_id="c1", queued_input_size=4200, last_mean_input_tps=100_000.0)
    payload = b'{"stream": true, "messages": [{"role": "user", "content": "hi \xc3\xa9"}]}'
    status, headers, body = await sg.post(
        {
            "x-routing-method": "power_of_two",
            "x-stargate-error-code": "e",
            "x-custom": "1",
            "x-stargate-expected-queue-ms": "999",
            "x-stargate-max-wait-ms": "5000",
        },
        payload,
        path=CHAT + "?trace=1&next=%3Fx%3D1&a=%2F",
    )
    assert status == 200 and body == b"".join(SSE_CHUNKS)
    assert headers["x-inference-server-id"] == "b1"
    assert headers["x-inference-server-url"] == backend.url
    assert headers["x-stargate-cluster-id"] == "c1"
    assert headers["x-upstream-header"] == "u" and "x-stargate-retry-reason" not in headers
    path_qs, seen, sent = backend.requests[0]
    assert path_qs == CHAT + "?trace=1&next=%3Fx%3D1&a=%2F" and sent == payload  # as the client sent it
    assert seen["x-custom"] == "1" and seen["x-model"] == MODEL and seen["x-request-id"] == "req-1"
    assert "x-routing-method" not in seen and "x-stargate-error-code" not in seen
    assert seen["x-stargate-expected-queue-ms"] == "42"  # 4200 tokens at 100k tps, not the client's 999
    assert seen["x-stargate-max-wait-ms"] == "5000"
    # the client sent neither: the proxy must not invent them (compression would reach the client)
    assert "accept-encoding" not in seen and "user-agent" not in seen


async def test_routing_headers_named_in_connection_still_reach_the_backend(sg: Harness) -> None:
    """Connection: x-model made them this hop's only, and Pylon then refused the request 400."""
    backend = await sg.backend("b1")
    status, _, _ = await sg.post(
        {"connection": "x-model, x-input-tokens, x-request-id, x-custom", "x-custom": "1"}
    )
    assert status == 200
    seen = backend.requests[0][1]
    assert (seen["x-model"], seen["x-input-tokens"], seen["x-request-id"]) == (MODEL, "10", "req-1")
    assert "x-custom" not in seen  # any other header it names stays this hop's


async def test_p27_free_slot_sends_zero_expected_queue(sg: Harness) -> None:
    backend = await sg.backend(
        "b1", max_engine_concurrency=8, num_running_queries=3, queued_input_size=50_000
    )
    assert (await sg.post())[0] == 200
    assert backend.requests[0][1]["x-stargate-expected-queue-ms"] == "0"


async def test_a_follow_up_behind_a_prompt_expected_cached_expects_its_whole_prompt() -> None:
    """Spec §3.10: the header is never scaled. R1 of a key is prefilling on the key's 1-slot
    backend, expected 90% cached; R2 of the key arrives before the next heartbeat. Pylon counts R1's
    whole prompt (1000 ms at 1000 tok/s): an expected 100 ms had it reject R2, which left its cache."""
    config = {
        "algorithm": "wait-and-widen",
        "load_aware": True,
        "cache_affinity_backend_selection_count": 1,
        "cache_affinity_input_tokens_scale": 0.1,
        "cache_affinity_wait_ms": 1000,
        "max_queued": 5,
    }
    async with running(lb_config=parse_lb_config({"models": {MODEL: config}})) as sg:
        backend = await sg.backend("b1", max_engine_concurrency=1, last_mean_input_tps=1000.0)
        backend.hold_headers = asyncio.Event()
        headers = {"x-input-tokens": "1000", "x-cache-affinity-key": "conversation"}
        first = asyncio.create_task(sg.post({**headers, "x-request-id": "r1"}))
        await until("R1 reached its backend", backend.arrived.is_set)
        second = asyncio.create_task(sg.post({**headers, "x-request-id": "r2"}))
        await until("R2 reached the backend", lambda: len(backend.requests) == 2)
        backend.hold_headers.set()
        assert (await first)[0] == (await second)[0] == 200
        assert backend.requests[0][1]["x-stargate-expected-queue-ms"] == "0"
        assert backend.requests[1][1]["x-stargate-expected-queue-ms"] == "1000"


async def test_response_streams_chunk_by_chunk(sg: Harness) -> None:
    backend = await sg.backend("b1")
    backend.gate = asyncio.Event()
    async with sg.http.post(sg.base + CHAT, headers=HEADERS, data=b"{}") as resp:
        assert resp.status == 200
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first == SSE_CHUNKS[0]  # arrived while the backend is still holding the stream open
        backend.gate.set()
        assert await resp.read() == b"".join(SSE_CHUNKS[1:])


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """Read one HTTP/1.1 request with a content-length body; return its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
    await reader.readexactly(length)
    return head


@contextlib.asynccontextmanager
async def raw_server(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A raw HTTP/1.1 backend on a free loopback port, answering each connection with ``serve``:
    its base URL."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def one_write_backend(body: bytes) -> AsyncIterator[str]:
    """A raw HTTP/1.1 backend that sends each whole answer (headers, chunked body, end) in one write."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await read_request(reader)
                if head.startswith(b"GET /health"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                else:
                    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                    writer.write(b"%b\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (head, len(body), body))
        writer.close()

    async with raw_server(serve) as url:
        yield url


async def test_an_upstream_body_read_whole_is_relayed_with_the_end_in_one_write(
    sg: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The headers go out at once (streaming); then the body and the chunked end share one send()."""
    from aiohttp.http_writer import StreamWriter

    writes: list[tuple[int, bytes]] = []
    plain, lines = StreamWriter._write, StreamWriter._writelines

    def record_write(self: StreamWriter, chunk: bytes) -> None:
        writes.append((id(self), bytes(chunk)))
        plain(self, chunk)

    def record_writelines(self: StreamWriter, chunks: list[bytes]) -> None:
        writes.append((id(self), b"".join(chunks)))
        lines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", record_write)
    monkeypatch.setattr(StreamWriter, "_writelines", record_writelines)
    body = b"".join(SSE_CHUNKS)
    async with one_write_backend(body) as url:
        backend = ScriptedBackend("raw")
        backend.url = url
        await sg.register(registration(backend))
        status, headers, got = await sg.post()
    assert (status, got, headers["x-inference-server-id"]) == (200, body, "raw")
    writer = next(w for w, data in writes if b"x-inference-server-id: raw" in data.lower())
    answer = [data for w, data in writes if w == writer]
    assert len(answer) == 2, answer
    assert answer[1] == b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


async def test_p89_two_backends_in_one_cluster_share_the_cluster_id(sg: Harness) -> None:
    await sg.backend("b1", cluster_id="c")
    await sg.backend("b2", cluster_id="c")
    seen = set()
    for _ in range(4):
        status, headers, _ = await sg.post()
        assert status == 200 and headers["x-stargate-cluster-id"] == "c"
        seen.add(headers["x-inference-server-id"])
    assert seen == {"b1", "b2"}


async def test_p127_selection_and_routing_duration_metrics(sg: Harness) -> None:
    await sg.backend("b1")
    assert (await sg.post())[0] == 200
    assert (
        sg.metric("stargate_routing_selections_total", **labels(algorithm="power-of-n", selection="primary"))
        == 1
    )
    assert sg.metric("stargate_routing_duration_seconds_count", **labels()) == 1
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="b1", status="200")) == 1
    assert (
        sg.metric("stargate_proxy_attempts_total", **labels(inference_server_id="b1", result="upstream_200"))
        == 1
    )
    assert sg.metric("stargate_proxy_replay_buffer_bytes_count", model=MODEL) == 1
    assert sg.metric("stargate_active_inference_servers", **labels()) == 1


# ---- body limits -------------------------------------------------------------------------------


async def test_compressed_body_reaches_the_backend_byte_identical(sg: Harness) -> None:
    backend = await sg.backend("b1")
    original = orjson.dumps({"stream": True, "messages": [{"role": "user", "content": "hi " * 2000}]})
    packed = gzip.compress(original)
    status, _, _ = await sg.post({"content-encoding": "gzip"}, packed)
    assert status == 200
    _, seen, body = backend.requests[0]
    assert body == packed and seen["content-encoding"] == "gzip"
    assert seen["content-length"] == str(len(packed))


async def test_corrupt_gzip_body_is_forwarded_not_a_stargate_error(sg: Harness) -> None:
    backend = await sg.backend("b1")
    corrupt = gzip.compress(b'{"stream": true}')[:-6] + b"garbage!"
    status, _, _ = await sg.post({"content-encoding": "gzip"}, corrupt)
    assert status == 200 and backend.requests[0][2] == corrupt


async def test_p106_declared_body_over_limit_is_413_before_routing() -> None:
    async with running(proxy=ProxySettings(max_replay_body_bytes=8)) as sg:
        status, _, body = await sg.post({"x-model": "nobody"}, b"x" * 15)
        assert status == 413 and orjson.loads(body)["error"]["code"] == "payload_too_large"


async def chunked(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_p107_retry_with_overflowed_body_is_413_with_backend_id() -> None:
    config = parse_lb_config({"default": "round-robin"})
    async with running(proxy=ProxySettings(max_replay_body_bytes=8), lb_config=config) as sg:
        backend = await sg.backend("r", rejection("upstream_admission_rejected"), cluster_id="c1")
        ok = await sg.backend("ok", cluster_id="c2")
        status, _, _ = await sg.post(body=chunked(b"12345", b"67890", b"abcde"))
        assert status == 413
        assert backend.requests[0][2] == b"1234567890abcde" and ok.requests == []
        assert sg.metric("stargate_requests_total", **labels(inference_server_id="r", status="413")) == 1


async def test_p107_single_rejecting_backend_with_overflow_is_413() -> None:
    async with running(proxy=ProxySettings(max_replay_body_bytes=8)) as sg:
        await sg.backend("r", rejection("upstream_admission_rejected"))
        status, _, _ = await sg.post(body=chunked(b"12345", b"67890", b"abcde"))
        assert status == 413
        assert sg.metric("stargate_requests_total", **labels(inference_server_id="r", status="413")) == 1


async def test_plain_client_compressed_body_is_read_away_from_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """60 KB of gzip can inflate to the read cap: read on the event loop it stalled every request."""
    threads = decoding_threads(monkeypatch, "stargate.router.plain_client")
    packed = gzip.compress(orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
    async with running(plain_clients=PlainClientSettings()) as sg:
        backend = await sg.backend("b1")
        async with sg.http.post(sg.base + CHAT, data=packed, headers={"content-encoding": "gzip"}) as resp:
            assert resp.status == 200
        assert backend.requests[0][2] == packed
        assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_a_plain_client_refused_before_routing_gets_a_made_up_request_id() -> None:
    async with running(plain_clients=PlainClientSettings()) as sg:
        await sg.backend("b1")
        for body, headers in ((b"not json", {}), (b"{}", {"content-encoding": "br"})):
            async with sg.http.post(sg.base + CHAT, data=body, headers=headers) as resp:
                assert resp.status in (400, 415) and resp.headers["x-request-id"].startswith("sg-")
        async with sg.http.post(sg.base + "/v1/other", data=b"{}") as resp:
            assert resp.status == 404 and resp.headers["x-request-id"].startswith("sg-")
        async with sg.http.get(sg.base + "/healthz") as resp:
            assert resp.status == 200 and "x-request-id" not in resp.headers


async def test_a_plain_clients_non_ascii_session_id_keys_it_by_digest() -> None:
    """Dropped as no header value before: such a conversation lost its replica."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    async with running(plain_clients=PlainClientSettings()) as sg:
        backend = await sg.backend("b1")
        for session in ("jos\u00e9", "plain-7"):
            async with sg.http.post(sg.base + CHAT, data=body, headers={"x-session-id": session}) as resp:
                assert resp.status == 200
        keys = [headers.get("x-cache-affinity-key") for _, headers, _ in backend.requests]
    assert keys == [body_key("jos\u00e9"), "plain-7"] and keys[0].startswith("sha256:")


async def test_bodies_read_whole_wait_for_room_and_get_503_when_none_frees() -> None:
    """Plain-client bodies are read whole: beyond the router-wide room they wait, then get 503."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 30}]})
    async with running(
        plain_clients=PlainClientSettings(max_body_bytes=100),
        proxy=ProxySettings(max_buffered_body_bytes=100),
        http_body_read_timeout_ms=300,
    ) as sg:
        backend = await sg.backend("b1")
        backend.hold_headers = asyncio.Event()

        async def plain_post() -> tuple[int, bytes]:
            async with sg.http.post(sg.base + CHAT, data=body) as resp:
                return resp.status, await resp.read()

        first = asyncio.create_task(plain_post())
        await until("the first request reached its backend", backend.arrived.is_set)
        assert sg.metric("stargate_proxy_buffered_body_bytes") == len(body)  # held until answered
        status, answer = await plain_post()  # room for 100 - len(body): it waits, then gives up
        assert status == 503 and orjson.loads(answer)["error"]["code"] == "body_buffer_full"
        budget = sg.server.body_budget
        assert budget is not None
        budget.wait_s = 10.0  # from here a wait outlasts the test's steps on a slow machine
        waiting = asyncio.create_task(plain_post())
        await until("a second request waits for room", lambda: budget.waiting == 1)
        backend.hold_headers.set()  # the first one's answer begins: its room frees
        assert (await first)[0] == 200 and (await waiting)[0] == 200
        assert len(backend.requests) == 2 and backend.requests[1][2] == body
        status, _, _ = await sg.post(body=chunked(b"12", b"34"))  # streamed: kept, then given back
        assert status == 200
        assert sg.metric("stargate_proxy_buffered_body_bytes") == 0


# ---- retries -----------------------------------------------------------------------------------


async def round_robin(**overrides: object) -> contextlib.AbstractAsyncContextManager[Harness]:
    return running(lb_config=parse_lb_config({"default": "round-robin"}), **overrides)


async def test_p108_retryable_429_retries_other_cluster() -> None:
    async with await round_robin() as sg:
        r = await sg.backend("r", rejection("upstream_admission_rejected"), cluster_id="c1")
        await sg.backend("ok", cluster_id="c2")
        status, headers, _ = await sg.post()  # round robin starts at the first registered cluster
        assert (status, headers["x-inference-server-id"]) == (200, "ok")
        assert len(r.requests) == 1
        assert sg.metric("stargate_proxy_retries_total", **labels(reason="upstream_admission_rejected")) == 1
        assert (
            sg.metric(
                "stargate_proxy_attempts_total", **labels(inference_server_id="r", result="upstream_429")
            )
            == 1
        )
        assert (
            sg.metric(
                "stargate_proxy_attempts_total", **labels(inference_server_id="ok", result="upstream_200")
            )
            == 1
        )


async def test_p109_zero_budget_returns_429_without_retry_metadata(sg: Harness) -> None:
    await sg.backend("r", rejection("upstream_admission_rejected"))
    status, headers, body = await sg.post({"x-stargate-max-wait-ms": "0"})
    assert (status, body) == (429, b"busy")
    assert not any(name.startswith("x-stargate-retry") for name in headers)
    assert sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="retry_budget_exhausted")) == 1
    assert (
        sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="upstream_admission_rejected")) == 0
    )


async def test_p110_unsignalled_503_and_explicit_false_pass_through(sg: Harness) -> None:
    backend = await sg.backend(
        "r",
        Reply(503, body=b"down"),
        Reply(429, {"x-stargate-retryable": "false"}, b"no"),
        Reply(400, {"x-stargate-retryable": "true"}, b"bad"),
    )
    await sg.backend("ok", cluster_id="c2", queued_input_size=1_000_000)  # never preferred over "r"
    assert [(await sg.post())[::2] for _ in range(3)] == [(503, b"down"), (429, b"no"), (400, b"bad")]
    assert len(backend.requests) == 3
    assert sg.metric("stargate_proxy_retries_total", **labels(reason="retryable_upstream_response")) == 0


async def test_p110_bare_503_retried_without_required_signal() -> None:
    async with await round_robin(retry=RetrySettings(require_pylon_retry_signal=False)) as sg:
        r = await sg.backend("r", Reply(503), cluster_id="c1")
        await sg.backend("ok", cluster_id="c2")
        status, headers, _ = await sg.post()
        assert (status, headers["x-inference-server-id"], len(r.requests)) == (200, "ok", 1)
        assert sg.metric("stargate_proxy_retries_total", **labels(reason="retryable_upstream_response")) == 1


async def test_a_request_every_backend_refused_tells_the_client_when_to_try_again(sg: Harness) -> None:
    """Engines that asked for a pause (Pylon's ``x-stargate-retry-after-ms``) and a 503 of the
    router's own: the client learns the soonest, as an OpenAI SDK reads it, not an arbitrary backoff."""
    for name, cluster, after in (("a", "c1", "4000"), ("b", "c2", "2500")):
        refusal = rejection("engine_overloaded", status=503)
        refusal.headers["x-stargate-retry-after-ms"] = after
        await sg.backend(name, refusal, cluster_id=cluster)
    status, headers, body = await sg.post()
    assert (status, orjson.loads(body)["error"]["code"]) == (503, "no_selectable_backend")
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("3", "2500")


async def test_p111_retry_limit_returns_second_429() -> None:
    async with running(retry=RetrySettings(max_request_retries=1)) as sg:
        await sg.backend("a", rejection("upstream_admission_rejected"), cluster_id="c1")
        await sg.backend("b", rejection("upstream_admission_rejected"), cluster_id="c2")
        status, _, _ = await sg.post()
        assert status == 429
        assert (
            sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="upstream_admission_rejected"))
            == 1
        )


async def test_p112_single_rejecting_backend_ends_503_no_eligible_backend(sg: Harness) -> None:
    await sg.backend("r", rejection("upstream_admission_rejected"))
    status, headers, body = await sg.post()
    assert status == 503 and "x-stargate-error-code" not in headers
    assert orjson.loads(body)["error"]["code"] == "no_selectable_backend"
    assert sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="no_eligible_backend")) == 1
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="", status="503")) == 1


async def test_p113_queue_mismatch_releases_reservation_and_uses_other_cluster() -> None:
    async with await round_robin() as sg:
        a = await sg.backend(
            "a", rejection("queue_estimate_mismatch"), cluster_id="c1", num_running_queries=3
        )
        await sg.backend("b", cluster_id="c2")
        status, headers, _ = await sg.post()
        assert (status, headers["x-inference-server-id"]) == (200, "b")
        assert len(a.requests) == 1
        assert sg.metric("stargate_proxy_retries_total", **labels(reason="queue_estimate_mismatch")) == 1
        view = sg.server.state.view(Target(None, MODEL))
        assert view is not None
        (c1,) = [c for c in view.candidates if c.cluster_id == "c1"]
        assert c1.stats.num_running_queries == 3  # the released reservation left nothing behind


async def test_p114_queue_mismatch_tries_sibling_first(sg: Harness) -> None:
    a = await sg.backend("a", rejection("queue_estimate_mismatch"), cluster_id="c")
    await sg.backend("b", cluster_id="c")
    await sg.backend("z", cluster_id="other", queued_input_size=100_000)  # slower: never the first choice
    status, headers, _ = await sg.post()
    assert (status, headers["x-inference-server-id"]) == (200, "b")
    assert len(a.requests) == 1
    assert (
        sg.metric("stargate_routing_selections_total", **labels(algorithm="power-of-n", selection="primary"))
        == 1
    )


async def test_p116_dead_backend_without_connect_retries_is_502() -> None:
    async with running(retry=RetrySettings(max_connect_retries=0)) as sg:
        backend = await sg.backend("dead")
        await backend.stop()
        status, _, body = await sg.post()
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_transport_error"
        assert (
            sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="connect_retries_exhausted"))
            == 1
        )
        assert (
            sg.metric("stargate_quic_hot_path_reconnect_total", inference_server_id="dead", result="error")
            == 0
        )
        assert sg.metric("stargate_requests_total", **labels(inference_server_id="dead", status="502")) == 1


async def test_p117_unreachable_backend_fails_over_to_healthy_sibling(sg: Harness) -> None:
    dead = await sg.backend("a-dead", cluster_id="c")
    await sg.backend("b-ok", cluster_id="c")
    await sg.backend("z", cluster_id="slow", queued_input_size=100_000)
    await dead.stop()
    status, headers, _ = await sg.post()
    assert (status, headers["x-inference-server-id"]) == (200, "b-ok")
    assert sg.metric("stargate_proxy_retries_total", **labels(reason="connect_failover")) == 1


# ---- admission, inactive targets, waits ----------------------------------------------------------


async def test_p118_p119_input_work_admission() -> None:
    config = parse_lb_config({"models": {MODEL: {"algorithm": "power-of-n", "max_input_work_seconds": 0.5}}})
    async with running(lb_config=config) as sg:
        await sg.backend("b1", last_mean_input_tps=100.0, queued_input_size=100)
        status, headers, body = await sg.post({"x-input-tokens": "50"})
        assert (status, headers["x-stargate-error-code"]) == (503, "input_work_limit_exceeded")
        assert orjson.loads(body) == {
            "error": "input work admission limit exceeded",
            "code": "input_work_limit_exceeded",
        }
        assert (
            sg.metric("stargate_admission_rejections_total", **labels(reason="input_work_limit_exceeded"))
            == 1
        )
        assert (await sg.post({"x-model": "unregistered"}))[0] == 404


async def test_p120_inactive_backend_is_503_then_404_after_it_leaves(sg: Harness) -> None:
    backend = await sg.backend("b1", register=False)
    call = await sg.register(registration(backend, status=pb.INFERENCE_SERVER_STATUS_INACTIVE))
    status, headers, _ = await sg.post()
    assert status == 503 and "x-stargate-error-code" not in headers
    await call.done_writing()
    with contextlib.suppress(aio.AioRpcError):
        while await call.read() is not aio.EOF:
            pass
    await until("the target unadvertised", lambda: not sg.server.state.is_advertised(Target(None, MODEL)))
    status, headers, _ = await sg.post()
    assert (status, headers.get("x-stargate-error-code")) == (404, "no_eligible_candidates")


async def test_p121_wait_and_widen_waits_for_the_free_later_bucket() -> None:
    config = parse_lb_config({"default": "wait-and-widen"})
    async with running(lb_config=config) as sg:
        await sg.backend("fast-full", cluster_id="fast", max_engine_concurrency=1, num_running_queries=1)
        await sg.backend("slow-free", cluster_id="slow", queue_time_estimate_ms_by_priority={0: 40})
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, headers, _ = await sg.post({"x-max-wait-ms": "250"})
        elapsed = loop.time() - started
        assert (status, headers["x-inference-server-id"]) == (200, "slow-free")
        assert 0.005 <= elapsed < 2.0  # the second bucket unlocks after ~10 ms of waiting


# ---- discovery and lifecycle ---------------------------------------------------------------------


async def test_p125_models_endpoint_matches_grpc(sg: Harness) -> None:
    for name, model in (("a", "alpha"), ("b", "beta")):
        backend = ScriptedBackend(name)
        await backend.start()
        sg.backends.append(backend)
        message = pb.InferenceServerRegistration(inference_server_id=name, inference_server_url=backend.url)
        message.models[model].status = pb.INFERENCE_SERVER_STATUS_ACTIVE  # type: ignore[assignment]
        message.models[model].stats.last_mean_input_tps = 100.0
        await sg.register(message)
    async with sg.http.get(sg.base + "/v1/models?model_ids=%20alpha%20&model_ids=beta") as resp:
        assert resp.status == 200
        http_ids = orjson.loads(await resp.read())["model_ids"]
    grpc_ids = list(
        (await sg.discovery.ListModels(pb.ListModelsRequest(model_ids=[" alpha ", "beta"]))).model_ids
    )
    assert http_ids == grpc_ids == ["alpha", "beta"]
    async with sg.http.get(sg.base + "/v1/models?model_ids=%20") as resp:
        assert resp.status == 400
    async with sg.http.get(sg.base + "/v1/models") as resp:
        assert orjson.loads(await resp.read()) == {"model_ids": ["alpha", "beta"]}


async def test_p126_debug_state_has_explicit_fields_only(sg: Harness) -> None:
    await sg.backend("b1")
    async with sg.http.get(sg.base + "/debug/state") as resp:
        state = orjson.loads(await resp.read())
    config = state["config"]
    assert set(config) == {
        "stargate_id",
        "grpc_listen_addr",
        "model_discovery_listen_addr",
        "http_listen_addr",
        "metrics_listen_addr",
        "advertise_addr",
        "stargate_discovery_dns_name",
        "tunnel_protocol",
        "backend_connectivity",
        "direct_quic_connections",
    }
    assert config["stargate_id"] == "sg-test" and config["backend_connectivity"] == "direct"
    assert config["http_listen_addr"] == sg.base.removeprefix("http://")
    assert "tls_cert_pem" not in config
    assert state["active_model_ids"] == [MODEL]


async def test_debug_routing_shows_candidates_and_member_stats(sg: Harness) -> None:
    # Ours, not the original's: what the balancer sees, per target, cluster and backend.
    await sg.backend("b1", cluster_id="A", max_engine_concurrency=8, num_running_queries=3)
    await sg.backend("b2", cluster_id="A", max_engine_concurrency=4, num_running_queries=1)

    async def both_members() -> list[dict[str, Any]] | None:
        async with sg.http.get(sg.base + "/debug/routing") as resp:
            assert resp.status == 200
            targets: list[dict[str, Any]] = orjson.loads(await resp.read())["targets"]
        members = targets[0]["clusters"][0]["backends"] if targets else []
        return targets if len(members) == 2 else None

    targets = await value_of("both backends in /debug/routing", both_members)
    [target] = targets
    assert (target["routing_key"], target["model_id"]) == (None, MODEL)
    [cluster] = target["clusters"]
    assert cluster["cluster_id"] == "A"
    # Running count and concurrency limit are latest-wins fields (§1.6): b2 published last.
    assert (cluster["stats"]["num_running_queries"], cluster["stats"]["max_engine_concurrency"]) == (1, 4)
    by_id = {b["inference_server_id"]: b["stats"] for b in cluster["backends"]}
    assert by_id["b1"]["max_engine_concurrency"] == 8 and by_id["b2"]["num_running_queries"] == 1
    assert "url" not in orjson.dumps(targets).decode()


async def test_p124_health_and_readiness_then_drain(sg: Harness) -> None:
    await sg.backend("b1")
    for path in ("/healthz", "/readyz"):
        async with sg.http.get(sg.base + path) as resp:
            assert (resp.status, await resp.read()) == (200, b"")
    assert "connection" not in (await sg.post())[1]  # keep-alive while serving
    sg.server.begin_drain()
    async with sg.http.get(sg.base + "/readyz") as resp:
        assert resp.status == 503
    async with sg.http.get(sg.base + "/healthz") as resp:
        assert resp.status == 200
    # Still served while draining, each connection closed after its answer: a client that keeps
    # connections open opens its next one where the load balancer sends it now.
    status, headers, _ = await sg.post()
    assert (status, headers["connection"]) == (200, "close")


async def test_a_drained_router_stops_listening_before_it_drops_registrations(sg: Harness) -> None:
    """A request arriving as the drain ends finds no listener (its client retries elsewhere), not
    a router without registrations answering 404 "not served", which clients do not retry."""
    await sg.backend("b1")
    plane = sg.server.control_plane
    assert plane is not None
    stopped_with_listeners: list[bool] = []
    stop = plane.stop

    async def stop_noting(grace_s: float) -> None:
        stopped_with_listeners.append(bool(sg.server._runners))
        await stop(grace_s)

    plane.stop = stop_noting  # type: ignore[method-assign]
    assert await sg.server.shutdown(drain_timeout_s=1.0) is True
    assert stopped_with_listeners == [False]


async def test_metrics_served_on_separate_port_with_prefix() -> None:
    async with running(metrics_prefix="sgx_") as sg:
        await sg.backend("b1")
        await sg.post()
        assert sg.server.addresses is not None
        async with sg.http.get(f"http://{sg.server.addresses.metrics}/metrics") as resp:
            text = (await resp.read()).decode()
        assert "sgx_requests_total{" in text and "sgx_proxy_duration_seconds_bucket" in text
        assert 'sgx_tls_reloads_total{material_type="server_identity",result="success"} 0.0' in text
        async with sg.http.get(sg.base + "/metrics") as resp:
            assert resp.status == 404


async def test_unknown_path_and_wrong_method_get_json_errors(sg: Harness) -> None:
    async with sg.http.get(sg.base + CHAT, headers={"x-request-id": "req-9"}) as resp:
        assert (resp.status, resp.headers["Allow"]) == (405, "POST")
        assert resp.headers["x-request-id"] == "req-9"  # every answer carries the client's id
        error = (await resp.json())["error"]
        assert (
            error["code"] == "method_not_allowed"
            and "GET is not allowed on /v1/chat/completions" in error["message"]
        )
    async with sg.http.post(sg.base + "/v1/other", headers=HEADERS) as resp:
        assert resp.status == 404 and resp.headers["x-request-id"] == HEADERS["x-request-id"]
        assert (await resp.json())["error"] == {
            "message": "no such endpoint: POST /v1/other",
            "type": "invalid_request_error",
            "code": "not_found",
        }


async def test_error_answers_quote_client_values_short(sg: Harness) -> None:
    """A 7 000-character path or routing method came back whole in the error's message."""
    long = "x" * 7000
    async with sg.http.post(sg.base + "/v1/" + long, headers=HEADERS) as resp:
        message = (await resp.json())["error"]["message"]
        assert resp.status == 404 and message.startswith("no such endpoint: POST /v1/xxx")
        assert len(message) < 200
    status, _, body = await sg.post({"x-routing-method": long})
    message = orjson.loads(body)["error"]["message"]
    assert status == 400 and message.startswith('unknown x-routing-method "xxx') and len(message) < 200
    async with sg.http.get(sg.base + "/v1/models/" + long) as resp:
        message = (await resp.json())["error"]["message"]
        assert resp.status == 404 and len(message) < 250


def openai_chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    chunk = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def test_openai_client_streams_through_the_proxy(sg: Harness) -> None:
    backend = await sg.backend("b1")
    backend.chunks = (
        openai_chunk("Hel"),
        openai_chunk("lo"),
        openai_chunk(None, "stop"),
        b"data: [DONE]\n\n",
    )
    client = AsyncOpenAI(
        base_url=sg.base + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=10.0,
        default_headers={"x-request-id": "oa-1", "x-model": MODEL, "x-input-tokens": "5"},
    )
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream]
    assert "".join(parts) == "Hello"
    _, seen, body = backend.requests[0]
    assert seen["x-request-id"] == "oa-1" and seen["authorization"] == "Bearer unused"
    assert orjson.loads(body)["stream"] is True


async def test_openai_client_error_names_the_problem(sg: Harness) -> None:
    client = AsyncOpenAI(base_url=sg.base + "/v1", api_key="unused", max_retries=0, timeout=10.0)
    async with client:
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
    assert info.value.status_code == 400
    assert info.value.code == "invalid_request" and info.value.type == "invalid_request_error"
    assert "missing required header x-request-id" in str(info.value)


async def test_p124_shutdown_drains_in_flight_requests(sg: Harness) -> None:
    backend = await sg.backend("b1")
    backend.gate = asyncio.Event()
    async with sg.http.post(sg.base + CHAT, headers=HEADERS, data=b"{}") as resp:
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        shutdown = asyncio.create_task(sg.server.shutdown(drain_timeout_s=10.0))
        await until("draining", lambda: sg.server.endpoints.draining)
        async with sg.http.get(sg.base + "/readyz") as ready:
            assert ready.status == 503
        assert not shutdown.done()
        backend.gate.set()
        assert await resp.read() == b"".join(SSE_CHUNKS[1:])
    assert await asyncio.wait_for(shutdown, 10) is True


async def test_shutdown_reports_drain_timeout(sg: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """The drain's end is logged once; the streams it cuts are not the clients' hang-ups."""
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.gate = asyncio.Event()
    async with sg.http.post(sg.base + CHAT, headers=HEADERS, data=b"{}") as resp:
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert await sg.server.shutdown(drain_timeout_s=0.05) is False
        backend.gate.set()
    messages = [r.getMessage() for r in caplog.records]
    assert any("shutdown drain timeout" in m for m in messages)
    assert not [m for m in messages if "client closed the connection" in m]


async def test_requests_still_held_when_the_drain_runs_out_get_503(sg: Harness) -> None:
    """A held request was never sent anywhere: when the drain ends it gets a 503 its client can
    retry elsewhere, not a cut connection (nor a 404 once the control plane stopped)."""
    held = {**HEADERS, "x-model": "later", "x-max-wait-ms": "60000"}  # registers later: it waits
    answer = asyncio.create_task(sg.post(held))
    await until("the request is held", lambda: sg.server.proxy.in_flight == 1)  # type: ignore[union-attr]
    assert await sg.server.shutdown(drain_timeout_s=0.05) is False
    status, _, body = await asyncio.wait_for(answer, 5)
    error = orjson.loads(body)["error"]
    assert (status, error["code"], error["message"]) == (
        503,
        "no_selectable_backend",
        "the router is shutting down",
    )


async def test_upstream_dying_mid_stream_aborts_the_client_connection(
    sg: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await sg.backend("b1")
    backend.abort_after_first = True
    with caplog.at_level(logging.WARNING, logger="stargate.router.proxy"):
        async with sg.http.post(sg.base + CHAT, headers=HEADERS, data=b"{}") as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientError):
                await resp.read()
        await until("the cut logged", lambda: bool(caplog.records))
    # The line names the request, as the client can quote it (its x-request-id).
    assert f"request {HEADERS['x-request-id']} " in caplog.records[0].getMessage()
    await until(
        "the request counted",
        lambda: sg.metric("stargate_requests_total", **labels(inference_server_id="b1", status="200")) == 1,
    )
    # Its status was 200; the cut is counted apart, so a dashboard sees answers that broke.
    assert sg.metric("stargate_responses_cut_total", **labels(inference_server_id="b1", by="backend")) == 1
    assert sg.metric("stargate_responses_cut_total", **labels(inference_server_id="b1", by="client")) == 0


@contextlib.asynccontextmanager
async def dies_before_its_body() -> AsyncIterator[tuple[str, list[int]]]:
    """A raw HTTP/1.1 backend that sends 200 response headers and then resets the connection, as an
    engine killed while it prefills does; the list counts the requests it answered so."""
    answered: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            head = await read_request(reader)
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                await writer.drain()
                answered.append(1)
        writer.transport.abort()

    async with raw_server(serve) as url:
        yield url, answered


async def test_a_request_with_more_header_fields_than_the_next_hop_takes_is_refused(sg: Harness) -> None:
    """Each hop adds fields: a request at aiohttp's 128 was refused by Pylon or the engine."""
    backend = await sg.backend("b1")
    extra = {f"x-extra-{i}": "v" for i in range(100 - len(HEADERS) - 4)}  # Host, Content-Length, ...
    status, _, _ = await sg.post(extra)
    assert status == 200 and len(backend.requests) == 1
    status, _, body = await sg.post({**extra, "x-one-more": "v", "x-and-another": "v"})
    assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_request"
    assert orjson.loads(body)["error"]["message"].endswith("header fields, at most 100 are taken")
    assert len(backend.requests) == 1


async def test_a_backend_dying_before_its_first_byte_is_retried_on_a_sibling(sg: Harness) -> None:
    """The client is told nothing until the first body byte, so the request is not lost."""
    async with dies_before_its_body() as (url, answered):
        dying = ScriptedBackend("a-dying")
        dying.url = url
        await sg.register(registration(dying, "c"))
        await sg.backend("b-ok", cluster_id="c")
        await sg.backend("z", cluster_id="slow", queued_input_size=100_000)
        status, headers, body = await sg.post()
    assert (status, headers["x-inference-server-id"], body) == (200, "b-ok", b"".join(SSE_CHUNKS))
    assert answered == [1]
    assert sg.metric("stargate_proxy_retries_total", **labels(reason="connect_failover")) == 1
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="b-ok", status="200")) == 1


@contextlib.asynccontextmanager
async def answers_with_fields(count: int) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw backend whose 200 answer carries ``count`` header fields; the list counts the requests
    it answered so."""
    answered: list[int] = []
    fields = b"".join(b"x-f%d: v\r\n" % i for i in range(count - 1))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while (await read_request(reader)).startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            answered.append(1)
            writer.write(b"HTTP/1.1 200 OK\r\n%bcontent-length: 2\r\n\r\nok" % fields)
            await writer.drain()
        writer.close()

    async with raw_server(serve) as url:
        yield url, answered


async def test_an_answer_with_the_fields_pylon_adds_is_read(sg: Harness) -> None:
    """An engine's 126 fields plus Pylon's own (date, server, transfer-encoding) reached Stargate
    past aiohttp's 128: the request ran two or three times, then ended 502 anyway."""
    async with answers_with_fields(128 + 12) as (url, answered):
        wide = ScriptedBackend("wide")
        wide.url = url
        await sg.register(registration(wide))
        async with (
            aiohttp.ClientSession(max_headers=200) as http,  # the client too reads past 128
            http.post(sg.base + CHAT, headers=HEADERS, data=b"{}") as resp,
        ):
            status, body = resp.status, await resp.read()
    assert (status, body, answered) == (200, b"ok", [1])


async def test_an_answer_whose_head_cannot_be_read_is_a_502_never_sent_again(sg: Harness) -> None:
    """The backend answered, so it ran the request: no reconnect, no other backend."""
    async with answers_with_fields(128 + 13) as (url, answered):
        wider = ScriptedBackend("wider")
        wider.url = url
        await sg.register(registration(wider, "c"))
        other = await sg.backend("z", cluster_id="slow", queued_input_size=100_000)
        status, _, body = await sg.post()
    assert status == 502 and answered == [1] and other.requests == []
    error = orjson.loads(body)["error"]
    assert error["code"] == "upstream_transport_error" and "unreadable head" in error["message"]
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="wider", status="502")) == 1
    assert sg.metric("stargate_proxy_retries_total", **labels(reason="hot_path_reconnect")) == 0


async def test_a_lone_backend_dying_before_its_first_byte_gets_an_error_answer(sg: Harness) -> None:
    """No other backend to retry on: the client gets the failure that happened, not the 503 of a
    request nobody could take."""
    async with dies_before_its_body() as (url, answered):
        dying = ScriptedBackend("dying")
        dying.url = url
        await sg.register(registration(dying))
        status, headers, body = await sg.post()
    assert status == 502 and answered == [1]
    assert headers["content-type"].startswith("application/json")
    assert orjson.loads(body)["error"]["code"] == "upstream_transport_error"
    assert sg.metric("stargate_proxy_retry_exhausted_total", **labels(reason="no_eligible_backend")) == 1
    assert sg.metric("stargate_requests_total", **labels(inference_server_id="dying", status="502")) == 1


async def test_response_header_timeout_of_a_backend_that_left_routing_is_a_transport_failure() -> None:
    probes = HealthSettings(interval_s=0.05, timeout_s=0.1, recheck_s=0.05)
    retry = RetrySettings(max_connect_retries=0)
    async with running(request_timeout_ms=100, retry=retry, health=probes) as sg:
        backend = await sg.backend("slow")
        backend.hold_headers = asyncio.Event()
        backend.hold_health = asyncio.Event()  # frozen: its health probes fail, and it is ejected
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, _, _ = await sg.post()
        assert status == 502 and 0.09 <= loop.time() - started < 5.0
        assert (
            sg.metric(
                "stargate_proxy_attempts_total", **labels(inference_server_id="slow", result="proxy_502")
            )
            == 1
        )
        backend.hold_headers.set()
        backend.hold_health.set()


async def test_a_request_past_a_backends_connections_waits_for_one_and_probes_are_not_queued() -> None:
    """An engine with more slots than Stargate's connections to it: a request past them failed 502
    after the connect timeout, and health probes queued behind them took the backend out."""
    probes = HealthSettings(interval_s=0.05, timeout_s=0.1, recheck_s=0.05)
    async with running(backend_connection_limit=1, connect_timeout_ms=100, health=probes) as sg:
        backend = await sg.backend("b1")
        backend.hold_headers = asyncio.Event()
        first = asyncio.ensure_future(sg.post())
        await until("the first request holds the connection", lambda: len(backend.requests) == 1)
        second = asyncio.ensure_future(sg.post())
        checked = backend.health_checks
        # Ten probes answered: ten probe periods, five connect timeouts; neither may fire.
        await until("ten more health probes", lambda: backend.health_checks >= checked + 10)
        assert not second.done() and len(backend.requests) == 1
        assert sg.metric("stargate_active_inference_servers", **labels()) == 1
        backend.hold_headers.set()
        assert ((await first)[0], (await second)[0]) == (200, 200)


# ---- affinity wait X through the real wait-and-widen policy (seed PR) ----------------------------

AFFINITY_CONFIG = {
    "default": "wait-and-widen",
    "models": {
        MODEL: {
            "algorithm": "wait-and-widen",
            "cache_affinity_backend_selection_count": 1,
            "cache_affinity_wait_ms": 200,
        }
    },
}


def key_owned_by(cluster_id: str, clusters: tuple[str, ...]) -> str:
    """An affinity key whose one-member affinity group is ``cluster_id`` (default seed, no routing key)."""
    from stargate.balancer.ring import AffinityRing, hash_prefix

    ring = AffinityRing(hash_prefix("", Target(None, MODEL)), clusters, 150)
    for i in range(1000):
        key = f"prefix-{i}"
        if [clusters[j] for j in ring.select(key, 1)] == [cluster_id]:
            return key
    raise AssertionError("no key found")


async def affinity_setup(sg: Harness, affine_full: bool) -> str:
    stats = {"max_engine_concurrency": 1, "num_running_queries": 1 if affine_full else 0}
    await sg.backend("a", cluster_id="A", **stats)
    await sg.backend("c", cluster_id="C", max_engine_concurrency=4)
    return key_owned_by("A", ("A", "C"))


async def test_p139_p142_affine_full_waits_out_x_then_global_fallback() -> None:
    async with running(lb_config=parse_lb_config(AFFINITY_CONFIG)) as sg:
        key = await affinity_setup(sg, affine_full=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, headers, _ = await sg.post({"x-cache-affinity-key": key})
        elapsed = loop.time() - started
        assert (status, headers["x-inference-server-id"]) == (200, "c")
        assert 0.19 <= elapsed < 5.0  # global buckets stay closed for X = 200 ms
        selection = labels(algorithm="wait-and-widen", selection="fallback")
        assert sg.metric("stargate_routing_selections_total", **selection) == 1


async def test_p140_affine_with_capacity_is_chosen_immediately_as_primary() -> None:
    async with running(lb_config=parse_lb_config(AFFINITY_CONFIG)) as sg:
        key = await affinity_setup(sg, affine_full=False)
        status, headers, _ = await sg.post({"x-cache-affinity-key": key})
        assert (status, headers["x-inference-server-id"]) == (200, "a")
        selection = labels(algorithm="wait-and-widen", selection="primary")
        assert sg.metric("stargate_routing_selections_total", **selection) == 1


async def test_p143_short_max_wait_ends_503_before_global_opens() -> None:
    async with running(lb_config=parse_lb_config(AFFINITY_CONFIG)) as sg:
        key = await affinity_setup(sg, affine_full=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        status, headers, _ = await sg.post({"x-cache-affinity-key": key, "x-max-wait-ms": "50"})
        elapsed = loop.time() - started
        assert status == 503 and "x-stargate-error-code" not in headers
        assert 0.045 <= elapsed < 2.0  # the routing deadline, not X, ended it


async def test_a_backend_whose_answers_are_server_errors_leaves_routing_for_a_while() -> None:
    async with await round_robin() as sg:
        bad = await sg.backend("bad", Reply(500, body=b"boom"), cluster_id="c1")
        await sg.backend("good", cluster_id="c2")
        statuses = [(await sg.post())[0] for _ in range(2 * SERVER_ERRORS_IN_A_ROW + 10)]
        assert statuses.count(500) == SERVER_ERRORS_IN_A_ROW == len(bad.requests)
        assert statuses[-10:] == [200] * 10  # out of routing once its 5th answer was an error


async def test_a_backend_that_cuts_every_answer_leaves_routing_for_a_while() -> None:
    """Each answer began: a row reset at an answer's first byte never grew."""
    async with await round_robin() as sg:
        bad = await sg.backend("bad", cluster_id="c1")
        bad.abort_after_first = True
        await sg.backend("good", cluster_id="c2")
        outcomes = []
        for _ in range(2 * SERVER_ERRORS_IN_A_ROW + 10):
            try:
                outcomes.append((await sg.post())[1]["x-inference-server-id"])
            except aiohttp.ClientPayloadError:
                outcomes.append("cut")
        assert outcomes.count("cut") == SERVER_ERRORS_IN_A_ROW == len(bad.requests)
        assert outcomes[-10:] == ["good"] * 10


async def test_a_backend_that_refuses_every_request_without_the_retry_signal_leaves_routing_for_a_while() -> (
    None
):
    async with await round_robin() as sg:
        bad = await sg.backend("bad", Reply(429, body=b"slow down"), cluster_id="c1")
        await sg.backend("good", cluster_id="c2")
        statuses = [(await sg.post())[0] for _ in range(2 * SERVER_ERRORS_IN_A_ROW + 10)]
        assert statuses.count(429) == SERVER_ERRORS_IN_A_ROW == len(bad.requests)
        assert statuses[-10:] == [200] * 10


async def test_a_backend_whose_answers_for_one_model_are_server_errors_leaves_routing_for_it_only() -> None:
    """It serves "m" well, and "only" where nobody else does: both stay; "m2" leaves."""
    async with await round_robin() as sg:
        bad = await sg.backend("bad", cluster_id="c1", models=(MODEL, "m2", "only"))
        bad.by_model["m2"] = Reply(500, body=b"boom")
        await sg.backend("good", cluster_id="c2", models=(MODEL, "m2"))
        m2 = [(await sg.post({"x-model": "m2"}))[0] for _ in range(2 * SERVER_ERRORS_IN_A_ROW + 10)]
        assert m2.count(500) == SERVER_ERRORS_IN_A_ROW and m2[-10:] == [200] * 10
        served = [(await sg.post())[1]["x-inference-server-id"] for _ in range(4)]
        assert sorted(served) == ["bad", "bad", "good", "good"]
        status, headers, _ = await sg.post({"x-model": "only"})
        assert (status, headers["x-inference-server-id"]) == (200, "bad")


async def test_a_backend_that_drops_every_request_unanswered_leaves_routing_for_a_while() -> None:
    """It passes its probes and ends each request at once: counted like server errors, it no longer
    draws traffic while it fails every request sent to it."""
    async with await round_robin() as sg:
        bad = await sg.backend("bad", cluster_id="c1")
        bad.abort_before_answer = True
        await sg.backend("good", cluster_id="c2")
        statuses = [(await sg.post())[0] for _ in range(2 * SERVER_ERRORS_IN_A_ROW + 10)]
        # Each tried it twice (a second time on a fresh connection), then went to the other.
        assert statuses == [200] * len(statuses)
        # Each attempt counted: out of routing after the 5th.
        assert SERVER_ERRORS_IN_A_ROW <= len(bad.requests) < 2 * SERVER_ERRORS_IN_A_ROW
