"""Fuzzed requests against a live in-process fleet: a real Stargate, a real Pylon registered over real
gRPC, and a real mock engine, all on loopback sockets.

Fuzzed contract headers and bodies (random JSON and bytes, content encodings, huge, negative and
overflowing numbers, unicode) and malformed HTTP/1.1 framing sent to Stargate's and Pylon's ports are
answered with a status the spec documents (never a 500), or the connection is closed; afterwards the
Pylon is still registered and a normal request still succeeds. No client-caused log record carries
a traceback.
"""

from __future__ import annotations

import io
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.stargate_harness import settings as stargate_settings
from support.waiting import until

from stargate.bench.fuzz_cases import (
    DOCUMENTED_STATUSES,
    NUMERIC_HEADERS,
    PATHS,
    TEXT_HEADERS,
    chat_body,
    exchange,
    framing_cases,
    fuzz_body,
    fuzz_headers,
    plain_headers,
    request_bytes,
)
from stargate.mock_engine import Engine, EngineConfig, TimingConfig, start_server
from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings
from stargate.router import state as routing_state
from stargate.router.app import StargateServer
from stargate.router.plain_client import PlainClientSettings
from stargate.wire import headers as h

MODEL = "m"
TIMEOUT = aiohttp.ClientTimeout(total=10)
RAW_TIMEOUT_S = 3.0
INCOMPLETE_WAIT_S = 0.3
FUZZ = settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Fleet:
    stargate: StargateServer
    pylon: PylonApp
    http: aiohttp.ClientSession
    stargate_addr: str
    pylon_addr: str
    stargate_grpc: str

    def addr(self, target: str) -> str:
        return self.stargate_addr if target == "stargate" else self.pylon_addr

    def registered(self) -> bool:
        connected = self.pylon.metrics.registry.get_sample_value(
            "pylon_registration_stream_connected", {"router": self.stargate_grpc}
        )
        return connected == 1 and self.stargate.state.list_models(None, []) == [MODEL]

    async def normal_request(self, request_id: str = "normal") -> int:
        headers = {h.REQUEST_ID: request_id, h.MODEL: MODEL, h.INPUT_TOKENS: "5",
                   "content-type": "application/json"}  # fmt: skip
        body = orjson.dumps(chat_body(MODEL))
        url = f"http://{self.stargate_addr}{PATHS[0]}"
        async with self.http.post(url, data=body, headers=headers) as resp:
            await resp.read()
            return resp.status


@pytest.fixture
async def fleet(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Fleet]:
    # A router that has been up a while: in its first 10 s a request with a routing wait for a
    # model nobody advertises waits for registrations (docs/compat.md), past these cases' timeout.
    monkeypatch.setattr(routing_state, "STARTUP_GRACE_S", 0.0)
    engine = Engine(EngineConfig(model=MODEL, timing=TimingConfig(num_tokens=3, token_delay_ms=1)))
    runner: web.AppRunner
    runner, engine_url = await start_server(engine, "127.0.0.1", 0)
    server = StargateServer(stargate_settings(plain_clients=PlainClientSettings()))
    pylon: PylonApp | None = None
    try:
        bound = await server.start()
        pylon = PylonApp(
            parse_settings(["--upstream-http-base-url", engine_url, "--stargate-address", bound.grpc,
                            "--http-listen-addr", "127.0.0.1:0", "--metrics-port", "0",
                            "--metrics-host", "127.0.0.1", "--model-name", MODEL, "--disable-bringup",
                            "--initial-input-tps", "1000", "--min-update-interval-ms", "50",
                            "--active-canary-interval-ms", "0"]),
            out=io.StringIO(),
        )  # fmt: skip
        await pylon.start()
        async with aiohttp.ClientSession(timeout=TIMEOUT, skip_auto_headers=("Content-Type",)) as http:
            fleet = Fleet(server, pylon, http, bound.http, pylon.http_url.removeprefix("http://"), bound.grpc)
            await until("the Pylon registered", fleet.registered)
            yield fleet
    finally:
        if pylon is not None:
            await pylon.close()
        await server.shutdown(drain_timeout_s=1.0)
        await runner.cleanup()


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()} ({r.exc_info[1]!r})" for r in caplog.records if r.exc_info]


async def still_serving(fleet: Fleet) -> None:
    assert fleet.registered(), "the Pylon's registration did not survive"
    assert await fleet.normal_request() == 200


# Any text but lone surrogates (``request_bytes`` sends controls as they are, CR and LF as spaces).
HEADER_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
NUMBER_TEXT = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.integers(min_value=18, max_value=5000).map(lambda n: "9" * n),
    st.integers(min_value=0, max_value=6000).map(lambda n: "0" * n + "5"),
    st.sampled_from(["+5", " 7 ", "", "1e3", "-0", "18446744073709551616", "4294967296"]),
)
VALUES = {name: st.one_of(NUMBER_TEXT, HEADER_TEXT) for name in NUMERIC_HEADERS}
WORDS = st.sampled_from(["m", "round-robin", "pulsar", " "])
VALUES |= {name: st.one_of(HEADER_TEXT, WORDS) for name in TEXT_HEADERS}
VALUES |= {"content-encoding": st.sampled_from(["gzip", "br", "identity", "x", "gzip, br"]),
           "content-type": st.sampled_from(["application/json", "text/plain", "", "application/json; x"]),
           "connection": st.sampled_from(["close", "keep-alive, x-model", "upgrade"]),
           h.INFERENCE_SERVER_ID: HEADER_TEXT, "expect": st.sampled_from(["100-continue", "x"])}  # fmt: skip
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64), st.floats(), HEADER_TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(HEADER_TEXT, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, str], bytes]:
    headers = {h.REQUEST_ID: "fuzz", h.MODEL: MODEL, h.INPUT_TOKENS: "5", "content-type": "application/json"}
    for name in draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=4, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            headers.pop(name, None)
        else:
            headers[name] = draw(VALUES[name])
    kind = draw(st.sampled_from(["chat", "json", "bytes", "cases"]))
    if kind == "chat":
        body = orjson.dumps(chat_body(MODEL, draw(st.integers(min_value=-(2**63), max_value=2**63 - 1))))
    elif kind == "json":
        body = _dumps(draw(JSON))
    elif kind == "bytes":
        body = draw(st.binary(max_size=300))
    else:
        body, extra = fuzz_body(draw(st.randoms(use_true_random=False)), MODEL)
        headers.update(extra)
    return draw(st.sampled_from(["stargate", "pylon"])), draw(st.sampled_from(PATHS)), headers, body


def _dumps(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # integers past 64 bits: written by hand, as a client may
        return repr(value).encode()


DEEP = b'{"model":"m","stream":true,"messages":' + b"[" * 1000 + b'"x"' + b"]" * 1000 + b"}"
UNKNOWN_MODEL_WAITING = {h.REQUEST_ID: "unknown", h.MODEL: "round-robin", h.INPUT_TOKENS: "5",
                         "content-type": "application/json", h.MAX_WAIT_MS: "9" * 18,
                         "content-encoding": "gzip"}  # fmt: skip
LONG_ZEROS = {h.REQUEST_ID: "zeros", h.MODEL: MODEL, h.INPUT_TOKENS: "0" * 4400 + "5",
              "content-type": "application/json"}  # fmt: skip


@FUZZ
@given(request=requests())
@example(request=("stargate", PATHS[0], LONG_ZEROS, orjson.dumps(chat_body(MODEL))))  # the engine's int()
@example(request=("pylon", PATHS[1], LONG_ZEROS, orjson.dumps({**chat_body(MODEL), "input": "hi"})))
@example(request=("stargate", PATHS[0], plain_headers("deep"), DEEP))  # plain-client mode reads it
@example(request=("stargate", PATHS[2], UNKNOWN_MODEL_WAITING, b'{"model":"'))  # 404, not a 60 s wait
async def test_fuzzed_headers_and_bodies_get_documented_statuses(
    fleet: Fleet, caplog: pytest.LogCaptureFixture, request: tuple[str, str, dict[str, str], bytes]
) -> None:
    target, path, headers, body = request
    answer = await exchange(fleet.addr(target), request_bytes(path, headers, body), RAW_TIMEOUT_S)
    assert answer.status in DOCUMENTED_STATUSES, (answer, target, headers)
    await still_serving(fleet)
    assert not tracebacks(caplog)


@pytest.mark.parametrize("target", ["stargate", "pylon"])
async def test_malformed_framing_gets_4xx_or_a_close_and_the_server_keeps_serving(
    fleet: Fleet, target: str
) -> None:
    addr = fleet.addr(target)
    for case in framing_cases(MODEL):
        answer = await exchange(addr, case.data, RAW_TIMEOUT_S if case.complete else INCOMPLETE_WAIT_S)
        if case.complete:
            assert answer.status is None or answer.status in DOCUMENTED_STATUSES, (case.name, answer)
            assert answer.status is not None or answer.closed, (case.name, "no answer and still open")
        else:
            assert answer.status is None or answer.status < 500, (case.name, answer)
    await still_serving(fleet)


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=400), target=st.sampled_from(["stargate", "pylon"]))
async def test_random_bytes_after_a_request_line_get_4xx_or_a_close(
    fleet: Fleet, caplog: pytest.LogCaptureFixture, data: bytes, target: str
) -> None:
    addr = fleet.addr(target)
    answer = await exchange(addr, b"POST /v1/chat/completions HTTP/1.1\r\n" + data, INCOMPLETE_WAIT_S)
    assert answer.status is None or answer.status < 500, answer
    await still_serving(fleet)
    assert not tracebacks(caplog)


async def test_client_faults_log_no_traceback(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """Fuzzed requests, malformed framing and clients that hang up mid-response, on both ports: no
    log record carries a traceback (a client's fault is one WARNING line)."""
    rng = random.Random(7)
    for addr in (fleet.stargate_addr, fleet.pylon_addr):
        for case in framing_cases(MODEL):
            await exchange(addr, case.data, RAW_TIMEOUT_S if case.complete else INCOMPLETE_WAIT_S)
        for i in range(20):
            body, extra = fuzz_body(rng, MODEL)
            headers = fuzz_headers(rng, MODEL, f"fz-{i}") | extra
            await exchange(addr, request_bytes(rng.choice(PATHS), headers, body), RAW_TIMEOUT_S)
        slow = {h.REQUEST_ID: "gone", h.MODEL: MODEL, h.INPUT_TOKENS: "5", "content-type": "application/json"}
        long_answer = orjson.dumps(chat_body(MODEL, 50))
        await exchange(addr, request_bytes(PATHS[0], slow, long_answer), INCOMPLETE_WAIT_S / 10)
    await still_serving(fleet)
    assert not tracebacks(caplog), "\n".join(sorted({t[:150] for t in tracebacks(caplog)}))
