"""Client-caused faults on Stargate's and Pylon's HTTP listeners: one rate-limited WARNING line each,
no traceback, no ERROR; connections whose request head stalls are closed after the head timeout."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import socket
from collections.abc import AsyncIterator

import orjson
import pytest
from support import waiting
from support.pylon_fakes import FakeEngine
from support.stargate_harness import CHAT, Harness, running

from stargate.balancer.types import Target
from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings
from stargate.router.cli import build_parser, settings_from_args
from stargate.wire import http_server
from stargate.wire.client_faults import ClientFaults

BURST = 3
HEAD_TIMEOUT_MS = 200
STALL_TIMEOUT_MS = 300  # the body and send timeouts
TIMEOUTS = {
    "http_header_read_timeout_ms": HEAD_TIMEOUT_MS,
    "http_body_read_timeout_ms": STALL_TIMEOUT_MS,
    "http_send_timeout_ms": STALL_TIMEOUT_MS,
}
MALFORMED = [
    b"GET / HTTP/9.x\r\nHost: a\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX Y: a\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\nzz\r\n",
]
PYLON_CHAT = orjson.dumps({"model": "llama", "messages": [], "stream": True})


def frozen_faults(name: str) -> ClientFaults:
    """A bucket that never refills: exactly ``BURST`` lines per kind."""
    return ClientFaults(logging.getLogger(name), burst=BURST, per_s=1.0, clock=lambda: 0.0)


class Signal(logging.Handler):
    """Sets an event on every record of one logger: tests wait for the line instead of sleeping."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.event = asyncio.Event()
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.event.wait(), 5)
        self.event.clear()


@pytest.fixture
def router_log() -> AsyncIterator[Signal]:
    signal = Signal("test.router.clients")
    yield signal
    signal.logger.removeHandler(signal)


@pytest.fixture
def pylon_log() -> AsyncIterator[Signal]:
    signal = Signal("test.pylon.clients")
    yield signal
    signal.logger.removeHandler(signal)


@pytest.fixture
async def sg() -> AsyncIterator[Harness]:
    faults = frozen_faults("test.router.clients")
    async with running(client_faults=faults, **TIMEOUTS) as harness:
        yield harness


@pytest.fixture
async def pylon(engine: FakeEngine) -> AsyncIterator[PylonApp]:
    settings = parse_settings(
        [
            *("--upstream-http-base-url", engine.url, "--stargate-address", "127.0.0.1:9"),
            *("--metrics-port", "0", "--metrics-host", "127.0.0.1", "--model-name", "llama"),
            *("--disable-bringup", "--engine-stats-stream", "off"),
            *("--http-header-read-timeout-ms", str(HEAD_TIMEOUT_MS)),
            *("--http-body-read-timeout-ms", str(STALL_TIMEOUT_MS)),
            *("--http-send-timeout-ms", str(STALL_TIMEOUT_MS)),
        ]
    )
    app = PylonApp(settings, out=io.StringIO(), client_faults=frozen_faults("test.pylon.clients"))
    try:  # closed also when start fails part of the way
        await app.start()
        yield app
    finally:
        await app.close()


class Connections:
    """Raw client connections, all closed at teardown."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self, url: str, data: bytes = b"", *, receive_buffer: int = 0) -> asyncio.StreamReader:
        """``receive_buffer``: a small kernel receive buffer, for a client that stops reading."""
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.socket()
        if receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock, limit=receive_buffer or 2**16)
        self.writers.append(writer)
        if data:
            writer.write(data)
        return reader

    def send(self, data: bytes) -> None:
        """More bytes on the latest connection."""
        self.writers[-1].write(data)

    def abort(self) -> None:
        """The latest connection's client hangs up (a reset, no goodbye)."""
        self.writers[-1].transport.abort()

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@pytest.fixture
async def conns() -> AsyncIterator[Connections]:
    connections = Connections()
    yield connections
    await connections.close()


async def until(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    return await asyncio.wait_for(reader.readuntil(marker), 5)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed or reset the connection (whatever it still sent before)."""
    try:
        await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return True
    return reader.at_eof()


def head(path: str, body: bytes, model: str, request_id: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: a",
        "Content-Type: application/json",
        f"x-request-id: {request_id}",
        f"x-model: {model}",
        "x-input-tokens: 10",
        f"Content-Length: {len(body)}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def client_lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def assert_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """No traceback and nothing at ERROR, whoever logged it."""
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []


async def malformed_requests_get_400(conns: Connections, url: str) -> None:
    """Each gets the JSON error body naming the problem, and a closed connection."""
    for data in MALFORMED * 2:
        reader = await conns.open(url, data)
        answer = await asyncio.wait_for(reader.read(), 5)  # to the end: the server closed it
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400 Bad Request\r\n") and b"Content-Type: application/" in head
        error = orjson.loads(body)["error"]
        assert error["code"] == "invalid_request" and "\n" not in error["message"]
        too_long = b"a" * 9000 in data
        assert ("longer than 8190 bytes" in error["message"]) == too_long


def assert_burst_of_malformed_lines(caplog: pytest.LogCaptureFixture, name: str) -> None:
    lines = client_lines(caplog, name)
    assert len(lines) == BURST
    assert all(line.startswith("rejected a malformed request from 127.0.0.1:") for line in lines)
    assert "Bad status line" in lines[0] and "\n" not in "".join(lines)
    assert_quiet(caplog)


async def test_malformed_requests_to_stargate_log_the_burst_at_warning_without_traceback(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await malformed_requests_get_400(conns, sg.base)
    assert_burst_of_malformed_lines(caplog, "test.router.clients")


@pytest.mark.parametrize(
    ("data", "logged"),
    [
        (
            b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40,
            "Received HTTPS traffic on an HTTP port",
        ),
        (b"GARBAGE / HTTP/9.9\r\n\r\n", "Invalid method encountered"),
    ],
)
async def test_bytes_that_are_not_http_are_logged_too(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture, data: bytes, logged: str
) -> None:
    """A client using https:// on the plain port, or anything that is not HTTP: aiohttp logged
    these at DEBUG only, so the operator never saw why that client got nothing it could read."""
    caplog.set_level(logging.WARNING)
    reader = await conns.open(sg.base, data)
    assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.0 400 Bad Request")
    (line,) = client_lines(caplog, "test.router.clients")
    assert line.startswith("rejected a malformed request from 127.0.0.1:") and logged in line
    assert_quiet(caplog)


async def test_an_oversized_body_gets_413_and_logs_nothing(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await sg.backend("b1")
    declared = head(CHAT, b"", "m", "big").replace(b"Content-Length: 0", b"Content-Length: %d" % 2**40)
    reader = await conns.open(sg.base, declared + b"{")
    assert (await until(reader, b"\r\n\r\n")).startswith(b"HTTP/1.1 413")
    assert caplog.records == []


async def test_malformed_requests_to_pylon_log_the_burst_at_warning_without_traceback(
    pylon: PylonApp, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await malformed_requests_get_400(conns, pylon.http_url)
    assert_burst_of_malformed_lines(caplog, "test.pylon.clients")


async def test_client_abandoning_a_stream_through_stargate_logs_one_warning(
    sg: Harness, conns: Connections, router_log: Signal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.gate = asyncio.Event()
    reader = await conns.open(sg.base, head(CHAT, b"{}", "m", "gone-1") + b"{}")
    await until(reader, b'data: {"n":1}\n\n')
    conns.abort()
    backend.gate.set()  # the next chunk finds the client gone
    await router_log.wait()
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    assert client_lines(caplog, "test.router.clients") == [
        "client closed the connection mid-response (request id gone-1)"
    ]
    cut = {"routing_key": "", "model": "m", "inference_server_id": "b1", "by": "client"}
    assert sg.metric("stargate_responses_cut_total", **cut) == 1
    assert_quiet(caplog)


async def test_a_client_leaving_after_done_abandons_nothing_at_stargate(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    """The openai SDK closes its connection as it reads ``data: [DONE]``, before the end of a
    chunked body that an engine writes a moment later: the answer was whole, no cut to log."""
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.chunks = (b'data: {"n":1}\n\ndata: [DONE]\n\n',)
    backend.gate = asyncio.Event()  # the body's end waits after [DONE]
    reader = await conns.open(sg.base, head(CHAT, b"{}", "m", "done-1") + b"{}")
    await until(reader, b"data: [DONE]\n\n")
    conns.abort()
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    backend.gate.set()
    assert client_lines(caplog, "test.router.clients") == []
    cut = {"routing_key": "", "model": "m", "inference_server_id": "b1", "by": "client"}
    assert sg.metric("stargate_responses_cut_total", **cut) == 0
    ok = {"routing_key": "", "model": "m", "inference_server_id": "b1", "status": "200"}
    assert sg.metric("stargate_requests_total", **ok) == 1
    assert_quiet(caplog)


async def test_client_abandoning_its_request_body_at_stargate_logs_one_warning(
    sg: Harness, conns: Connections, router_log: Signal, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await sg.backend("b1")
    await conns.open(sg.base, head(CHAT, b"{" * 100, "m", "gone-2") + b"{")
    await conns.writers[-1].drain()
    conns.abort()
    await router_log.wait()
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    assert client_lines(caplog, "test.router.clients") == [
        "client closed the connection before its request body was complete (request id gone-2)"
    ]
    assert_quiet(caplog)


async def test_client_abandoning_a_stream_through_pylon_logs_one_warning(
    pylon: PylonApp,
    engine: FakeEngine,
    conns: Connections,
    pylon_log: Signal,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    engine.chat_mode = "hang"  # one keep-alive comment, then nothing until the engine closes
    reader = await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "gone-3"))
    conns.send(PYLON_CHAT)
    await until(reader, b": keepalive\n\n")
    conns.abort()  # Pylon's handler is cancelled at once, mid-response
    await pylon_log.wait()
    assert client_lines(caplog, "test.pylon.clients") == [
        "client closed the connection mid-response (request id gone-3)"
    ]
    assert_quiet(caplog)


async def test_a_client_leaving_after_done_abandons_nothing_at_pylon(
    pylon: PylonApp, engine: FakeEngine, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    engine.end_gate = asyncio.Event()
    reader = await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "done-2"))
    conns.send(PYLON_CHAT)
    await until(reader, b"data: [DONE]\n\n")
    conns.abort()
    registry = pylon.metrics.registry
    labels = {"model": "llama", "routing_key": "", "status": "complete"}
    await waiting.until("it ended", lambda: registry.get_sample_value("pylon_requests_total", labels) == 1)
    engine.end_gate.set()
    assert len(pylon.load) == 0
    cancelled = {"model": "llama", "routing_key": "", "status": "cancelled"}
    assert registry.get_sample_value("pylon_requests_total", cancelled) in (None, 0)
    assert client_lines(caplog, "test.pylon.clients") == []
    assert_quiet(caplog)


def hung_up(sg: Harness, model: str, backend: str = "") -> float:
    """Requests of ``model`` whose client hung up before the answer began (counted as 499), at
    ``backend`` ("" while routed)."""
    labels = {"model": model, "routing_key": "", "inference_server_id": backend, "status": "499"}
    return sg.metric("stargate_requests_total", **labels)


async def test_a_client_hanging_up_before_its_answer_cancels_the_request_at_the_backend(
    sg: Harness, conns: Connections, router_log: Signal, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-streamed answer sends nothing until its end: only the hang-up itself can stop the
    attempt, which otherwise held the backend's slot for the whole generation. The request and
    its attempt are counted at the backend (they were under "" and not at all)."""
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.hold_headers = asyncio.Event()  # never set: the backend is still generating
    await conns.open(sg.base, head(CHAT, b"{}", "m", "gone-4") + b"{}")
    await asyncio.wait_for(backend.arrived.wait(), 5)
    conns.abort()
    await asyncio.wait_for(backend.cancelled.wait(), 5)
    await router_log.wait()
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    assert hung_up(sg, "m", "b1") == 1 and hung_up(sg, "m") == 0
    attempts = {"model": "m", "routing_key": "", "inference_server_id": "b1", "result": "proxy_499"}
    assert sg.metric("stargate_proxy_attempts_total", **attempts) == 1
    (target,) = (await (await sg.http.get(sg.base + "/debug/routing")).json())["targets"]
    assert [c["in_flight"]["requests"] for c in target["clusters"]] == [0]
    assert client_lines(caplog, "test.router.clients") == [
        "client closed the connection before the response started (request id gone-4)"
    ]
    assert_quiet(caplog)


async def test_a_client_hanging_up_while_its_request_waits_for_a_model_leaves_the_router(
    sg: Harness, conns: Connections, router_log: Signal
) -> None:
    """A request held for its routing wait (here: a model not registered yet, the router just
    started) is dropped when its client hangs up, not kept until the wait ends."""
    held = head(CHAT, b"{}", "later", "gone-5").replace(
        b"x-input-tokens", b"x-max-wait-ms: 60000\r\nx-input-tokens"
    )
    await conns.open(sg.base, held + b"{}")
    await waiting.until("the request is in the router", lambda: sg.server.proxy.in_flight == 1)  # type: ignore[union-attr]
    conns.abort()
    await router_log.wait()
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    assert hung_up(sg, "later") == 1


async def test_stargate_hanging_up_cancels_the_request_at_the_engine(
    pylon: PylonApp,
    engine: FakeEngine,
    conns: Connections,
    pylon_log: Signal,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    engine.chat_mode = "silent"  # queued behind other work: no headers yet
    await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "gone-6") + PYLON_CHAT)
    await waiting.until("the engine received the request", lambda: engine.hits("/v1/chat/completions") == 1)
    conns.abort()
    await asyncio.wait_for(engine.cancelled.wait(), 5)
    await pylon_log.wait()
    labels = {"model": "llama", "routing_key": "", "status": "cancelled"}
    assert pylon.metrics.registry.get_sample_value("pylon_requests_total", labels) == 1
    assert len(pylon.load) == 0
    assert client_lines(caplog, "test.pylon.clients") == [
        "client closed the connection before the response started (request id gone-6)"
    ]
    assert_quiet(caplog)


async def test_stargate_closes_a_request_body_that_stalls_before_routing_it(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    """A body is received before its request is routed: one that stalls took a backend's slot."""
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    loop = asyncio.get_running_loop()
    reader = await conns.open(sg.base, head(CHAT, b"{" * 100, "m", "stalled") + b"{" * 10)
    started = loop.time()
    await waiting.until("the router reads the body", lambda: sg.server.proxy.in_flight == 1)  # type: ignore[union-attr]
    view = sg.server.state.view(Target(None, "m"))
    assert view is not None and view.candidates[0].in_flight.requests == 0  # not routed
    assert await closed_by_server(reader)
    assert loop.time() - started >= STALL_TIMEOUT_MS / 1000 * 0.9
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    assert hung_up(sg, "m") == 1 and not backend.cancelled.is_set()
    (line,) = client_lines(caplog, "test.router.clients")
    assert re.fullmatch(
        r"closed the connection from 127\.0\.0\.1:\d+: its request body sent nothing for 300 ms", line
    )
    assert_quiet(caplog)


async def test_a_request_body_that_keeps_coming_is_not_cut_however_long_it_takes(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    await sg.backend("b1")
    body = b"{" + b" " * 8 + b"}"
    reader = await conns.open(sg.base, head(CHAT, body, "m", "slow-body"))
    for i in range(0, len(body), 2):  # 5 pieces 100 ms apart: 500 ms in all, each gap < 300 ms
        conns.send(body[i : i + 2])
        await asyncio.sleep(STALL_TIMEOUT_MS / 3000)
    assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    assert client_lines(caplog, "test.router.clients") == []


async def test_a_body_pipelined_behind_a_request_in_hand_is_not_due_until_that_request_ends(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.hold_headers = asyncio.Event()  # the first answer takes longer than the body timeout
    first = head(CHAT, b"{}", "m", "in-hand") + b"{}"
    reader = await conns.open(sg.base, first + head(CHAT, b"{" * 10, "m", "pipelined") + b"{")
    await asyncio.wait_for(backend.arrived.wait(), 5)
    await asyncio.sleep(STALL_TIMEOUT_MS / 1000 * 2)  # the pipelined body is silent all along
    backend.hold_headers.set()
    assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    assert await closed_by_server(reader)  # then its own silence counts
    (line,) = client_lines(caplog, "test.router.clients")
    assert line.endswith("its request body sent nothing for 300 ms")


async def test_stargate_closes_a_connection_whose_client_reads_nothing_and_cancels_it_upstream(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.chunks = (b"data: " + b"x" * 2**20 + b"\n\n",) * 64  # more than every buffer on the way
    reader = await conns.open(sg.base, head(CHAT, b"{}", "m", "unread") + b"{}", receive_buffer=4096)
    await asyncio.wait_for(backend.cancelled.wait(), 10)
    assert await sg.server.proxy.wait_idle(5)  # type: ignore[union-attr]
    (line,) = client_lines(caplog, "test.router.clients")
    assert re.fullmatch(
        r"closed the connection to 127\.0\.0\.1:\d+: it read nothing of the answer for 300 ms", line
    )
    assert_quiet(caplog)
    # Reset: the megabytes the kernel held for the client are dropped, not sent on before a FIN.
    with pytest.raises(ConnectionResetError):
        while await asyncio.wait_for(reader.read(2**16), 5):
            pass


async def test_a_client_reading_slowly_but_steadily_is_not_cut(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    """Writing resumes only once about half of what the kernel holds for the client drained: a
    client reading 32 KB/s was cut, logged as having read nothing."""
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.chunks = (b"data: " + b"x" * 2**20 + b"\n\n",) * 16 + (b"data: [DONE]\n\n",)
    reader = await conns.open(sg.base, head(CHAT, b"{}", "m", "slow") + b"{}", receive_buffer=4096)
    got = 0
    for _ in range(20):  # 2 s at 320 KB/s: more than six send timeouts, each with bytes read
        got += len(await asyncio.wait_for(reader.readexactly(32_768), 5))
        await asyncio.sleep(0.1)
    assert got == 20 * 32_768 and client_lines(caplog, "test.router.clients") == []
    tail = b""
    async with asyncio.timeout(30):  # then the rest, at full speed, to its end
        while b"data: [DONE]" not in tail:
            chunk = await reader.read(2**16)
            assert chunk, "the connection ended before the answer"
            tail = (tail + chunk)[-64:]


async def test_pylon_closes_a_request_body_that_stalls_and_never_counts_it(
    pylon: PylonApp, engine: FakeEngine, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    """A request counts once its body is in: one trickling in counted as queued made the backend
    look full to every router while its engine ran nothing."""
    caplog.set_level(logging.WARNING)
    reader = await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "stalled"))
    conns.send(PYLON_CHAT[:5])
    assert pylon.relay is not None
    bodies = pylon.relay.bodies
    await waiting.until("Pylon reads the body", lambda: bodies.used > 0)
    assert len(pylon.load) == 0
    assert await closed_by_server(reader)
    await waiting.until("the body is given back", lambda: bodies.used == 0)
    assert len(pylon.load) == 0 and engine.hits("/v1/chat/completions") == 0
    assert (
        pylon.metrics.registry.get_sample_value(
            "pylon_requests_total", {"model": "llama", "routing_key": "", "status": "cancelled"}
        )
        is None
    )
    (line,) = client_lines(caplog, "test.pylon.clients")
    assert re.fullmatch(
        r"closed the connection from 127\.0\.0\.1:\d+: its request body sent nothing for 300 ms", line
    )
    assert_quiet(caplog)


async def slowloris(conns: Connections, url: str, count: int) -> list[asyncio.StreamReader]:
    """``count`` connections that send part of a request head (the first sends nothing at all)."""
    partial = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nx-mod"
    return [await conns.open(url, partial if i else b"") for i in range(count)]


async def test_stargate_closes_slow_heads_and_serves_everyone_else(
    sg: Harness, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    backend = await sg.backend("b1")
    backend.hold_headers = asyncio.Event()  # a complete request whose answer takes longer than the timeout
    keepalive = await conns.open(sg.base, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
    assert (await until(keepalive, b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    held = await conns.open(sg.base, head(CHAT, b"{}", "m", "slow-but-complete") + b"{}")
    await asyncio.wait_for(backend.arrived.wait(), 5)
    conns.send(b"GET /hea")  # a head pipelined behind the held request, never finished
    started = asyncio.get_running_loop().time()
    assert all([await closed_by_server(reader) for reader in await slowloris(conns, sg.base, 4)])
    assert asyncio.get_running_loop().time() - started >= HEAD_TIMEOUT_MS / 1000 * 0.9
    backend.hold_headers.set()
    assert (await until(held, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    assert await closed_by_server(held)  # then the pipelined head ran out of time
    # An idle keep-alive connection outlives the head timeout; a later head that stalls is cut.
    conns.writers[0].write(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
    assert (await until(keepalive, b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    conns.writers[0].write(b"GET /hea")
    assert await closed_by_server(keepalive)
    lines = client_lines(caplog, "test.router.clients")
    assert len(lines) == BURST and all("no complete request head within 200 ms" in line for line in lines)
    assert_quiet(caplog)


async def test_pylon_closes_slow_heads_including_a_trickling_one(
    pylon: PylonApp, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    readers = await slowloris(conns, pylon.http_url, 2)
    trickling = await conns.open(pylon.http_url)
    for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n" * 10:
        conns.send(bytes([byte]))  # a byte every 20 ms: data keeps coming, the head never ends
        try:
            assert await asyncio.wait_for(trickling.read(), 0.02) == b""
            break
        except TimeoutError:
            continue
    else:
        pytest.fail("the trickling connection was never closed")
    assert all([await closed_by_server(reader) for reader in readers])
    reader = await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "ok-1"))
    conns.send(PYLON_CHAT)
    assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    lines = client_lines(caplog, "test.pylon.clients")
    assert len(lines) == BURST and all("no complete request head within 200 ms" in line for line in lines)
    assert_quiet(caplog)


async def test_pylon_keeps_an_idle_keep_alive_connection_after_a_request_with_a_body(
    pylon: PylonApp, conns: Connections, caplog: pytest.LogCaptureFixture
) -> None:
    """Reading a request body must not start the next head's deadline: only its first byte does."""
    caplog.set_level(logging.WARNING)
    reader = await conns.open(pylon.http_url, head("/v1/chat/completions", PYLON_CHAT, "llama", "ka-1"))
    conns.send(PYLON_CHAT)
    assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    await until(reader, b"0\r\n\r\n")  # the end of the chunked answer
    await asyncio.sleep(HEAD_TIMEOUT_MS / 1000 * 2)  # idle, longer than the head timeout
    conns.send(head("/v1/chat/completions", PYLON_CHAT, "llama", "ka-2") + PYLON_CHAT)
    assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    assert client_lines(caplog, "test.pylon.clients") == []
    assert_quiet(caplog)


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(
    monkeypatch: pytest.MonkeyPatch, conns: Connections
) -> None:
    """aiohttp's own is an hour: one client's idle connections used up the file descriptors."""
    assert http_server.IDLE_KEEPALIVE_S == 75.0
    monkeypatch.setattr(http_server, "IDLE_KEEPALIVE_S", 0.5)
    async with running(**TIMEOUTS) as harness:
        await harness.backend("b1")
        reader = await conns.open(harness.base, head(CHAT, b"{}", "m", "idle-1") + b"{}")
        assert (await until(reader, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
        await until(reader, b"0\r\n\r\n")
        started = asyncio.get_running_loop().time()
        assert await closed_by_server(reader)
        assert asyncio.get_running_loop().time() - started >= 0.4


@pytest.mark.parametrize(
    ("flag", "default"),
    [
        ("http-header-read-timeout-ms", 10_000),
        ("http-body-read-timeout-ms", 60_000),
        ("http-send-timeout-ms", 60_000),
    ],
)
def test_both_binaries_take_the_client_timeout_flags(flag: str, default: int) -> None:
    field = flag.replace("-", "_")
    base = ["--stargate-id", "s", "--advertise-addr", "127.0.0.1:1", "--disable-dns-discovery"]
    assert getattr(settings_from_args(build_parser({}).parse_args(base)), field) == default
    options = build_parser({}).parse_args([*base, f"--{flag}", "0"])
    assert getattr(settings_from_args(options), field) == 0
    pylon = ["--upstream-http-base-url", "http://127.0.0.1:1", "--model-name", "m"]
    assert getattr(parse_settings(pylon), field) == default
    assert getattr(parse_settings([*pylon, f"--{flag}", "5"]), field) == 5


async def test_an_http_1_0_client_asking_for_keep_alive_sees_its_answer_end(
    sg: Harness, conns: Connections
) -> None:
    """HTTP/1.0 has no chunked framing: a relayed body of unknown length ends with the connection."""
    await sg.backend("b1")
    request = head(CHAT, b"{}", "m", "old-1").replace(b"HTTP/1.1", b"HTTP/1.0")
    reader = await conns.open(
        sg.base, request.replace(b"Host: a", b"Host: a\r\nConnection: keep-alive") + b"{}"
    )
    answer = await asyncio.wait_for(reader.read(), 5)  # to the close
    assert answer.startswith(b"HTTP/1.0 200 ") or answer.startswith(b"HTTP/1.1 200 ")
    assert reader.at_eof()


def expecting(request_head: bytes, expect: str = "100-continue") -> bytes:
    """``request_head`` asking the server to say whether it wants the body first."""
    return request_head.replace(b"\r\n\r\n", f"\r\nExpect: {expect}\r\n\r\n".encode(), 1)


async def test_an_expected_body_is_refused_before_it_is_sent_where_the_head_says_so(
    sg: Harness, conns: Connections
) -> None:
    """RFC 9110 §10.1.1: a 100 Continue for a request refused anyway had the client upload its body
    in vain."""
    await sg.backend("b1")
    ok = await conns.open(sg.base, expecting(head(CHAT, b"{}", "m", "expect-ok")))
    assert await until(ok, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    conns.send(b"{}")
    assert (await until(ok, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    too_large = head(CHAT, b"", "m", "expect-big").replace(b"Content-Length: 0", b"Content-Length: 99999999")
    missing_id = head(CHAT, b"{}", "m", "").replace(b"x-request-id: \r\n", b"")
    for request_head, status in (
        (expecting(too_large), b"413"),
        (expecting(missing_id), b"400"),
        (expecting(head(CHAT, b"{}", "m", "expect-odd"), "later"), b"417"),
    ):
        reader = await conns.open(sg.base, request_head)
        answer = await until(reader, b"}}")  # the final answer at once, no 100 first
        assert answer.startswith(b"HTTP/1.1 " + status) and b'"error"' in answer
        # The client may never send the body: a next request on the connection would be read as it.
        assert await closed_by_server(reader)


async def test_pylon_refuses_an_expected_body_before_it_is_sent_where_the_head_says_so(
    pylon: PylonApp, conns: Connections
) -> None:
    ok = await conns.open(pylon.http_url, expecting(head("/v1/chat/completions", PYLON_CHAT, "llama", "e1")))
    assert await until(ok, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    conns.send(PYLON_CHAT)
    assert (await until(ok, b"data: [DONE]\n\n")).startswith(b"HTTP/1.1 200")
    unknown = await conns.open(
        pylon.http_url, expecting(head("/v1/chat/completions", PYLON_CHAT, "other", "e2"))
    )
    answer = await until(unknown, b"}}")
    assert answer.startswith(b"HTTP/1.1 503") and b"application/problem+json" in answer
    assert await closed_by_server(unknown)
