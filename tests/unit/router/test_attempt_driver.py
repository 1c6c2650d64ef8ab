"""The attempt driver and the retry rules (§4.8) through a fake transport and fake routing state."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field

import pytest
from multidict import CIMultiDict
from support.balancer_builders import make_candidate
from support.router_fakes import (
    FakeBackend,
    FakeState,
    FakeView,
    FirstEligible,
    ScriptedPolicy,
    backend,
    make_request,
    make_view,
)

from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import UNAVAILABLE, Choice, Selected
from stargate.errors import UpstreamError, UpstreamNotSent, UpstreamTimeout
from stargate.router.attempt import AttemptMachine, RetrySettings
from stargate.router.driver import AttemptDriver, LocalFailure, Passthrough
from stargate.router.metrics import RouterMetrics
from stargate.router.replay import Readiness, ReplayBody
from stargate.router.retry_signal import retry_signal
from stargate.tracing import RouteTrace
from stargate.wire.body_budget import BodyBudget

DEFINITION = AlgorithmDefinition(Algorithm.ROUND_ROBIN)


@dataclass
class FakeResponse:
    status: int
    extra: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    released: bool = False
    reason: str | None = None
    broken: bool = False  # the body breaks before its first byte
    hold: asyncio.Event | None = None  # when set: the first byte waits for it
    more: tuple[bytes, ...] = ()  # chunks after ``body``

    @property
    def headers(self) -> Iterable[tuple[str, str]]:
        return self.extra.items()

    def header(self, name: str) -> str | None:
        return {k.lower(): v for k, v in self.extra.items()}.get(name.lower())

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.hold is not None:
            await self.hold.wait()
        if self.broken:
            raise UpstreamError("reset before the body")
        yield self.body
        for chunk in self.more:
            yield chunk

    def complete(self) -> bool:
        return True

    def release(self) -> None:
        self.released = True


DEAD = "dead"  # script entry: connection refused, the request never left
HUNG = "hung"  # script entry: no response headers in time
HALF = "half"  # script entry: read one chunk of the body, then fail
SILENT = "silent"  # script entry: sent, no response headers until cancelled
DROP = "drop"  # script entry: read the whole body, then closed unanswered


@dataclass
class FakeTransport:
    script: dict[str, list[FakeResponse | str]]
    reconnects: dict[str, bool] = field(default_factory=dict)
    sent: list[tuple[str, CIMultiDict[str], bytes]] = field(default_factory=list)

    async def send(
        self,
        backend: FakeBackend,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterable[bytes],
    ) -> FakeResponse:
        steps = self.script[backend.inference_server_id]
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        if step == DEAD:
            raise UpstreamNotSent("connection refused")
        if step == HUNG:
            raise UpstreamTimeout("no response headers in time")
        if step == SILENT:
            self.sent.append((backend.inference_server_id, headers, b""))
            await asyncio.Event().wait()
        data = bytearray()
        if isinstance(body, bytes):
            data.extend(body)
        else:
            async for chunk in body:
                data.extend(chunk)
                if step == HALF:
                    raise UpstreamError("reset mid-body")
        self.sent.append((backend.inference_server_id, headers, bytes(data)))
        if step == DROP:
            raise UpstreamError("connection closed before a response")
        assert isinstance(step, FakeResponse)
        return step

    async def reconnect(self, backend: FakeBackend) -> bool:
        return self.reconnects.get(backend.inference_server_id, False)


def retryable(status: int = 429, reason: str = "upstream_admission_rejected") -> FakeResponse:
    return FakeResponse(status, {"x-stargate-retryable": "true", "x-stargate-retry-reason": reason})


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def make_runner(
    clusters: dict[str, list[str]],
    script: dict[str, list[FakeResponse | str]],
    settings: RetrySettings | None = None,
    reconnects: dict[str, bool] | None = None,
    expected: dict[str, int | None] | None = None,
    clock: list[float] | None = None,
) -> tuple[AttemptDriver, FakeState, FakeTransport, RouterMetrics]:
    expected = expected or dict.fromkeys(clusters, 0)
    candidates = tuple(make_candidate(c, tps=0.0, queue_map={0: expected[c] or 0}) for c in clusters)
    view = FakeView(
        candidates, FirstEligible(), {c: [backend(b, c) for b in ids] for c, ids in clusters.items()}
    )
    state = FakeState(view)
    metrics = RouterMetrics()
    machine = AttemptMachine(
        settings or RetrySettings(),
        admission=lambda d, c, r: None,
        expected_queue=lambda c, p, load_aware: c.stats.queue_time_estimate_ms_by_priority.get(0) or None,
    )
    transport = FakeTransport(script, reconnects or {})
    now = clock if clock is not None else [10.0]
    driver = AttemptDriver(state, machine, transport, metrics, clock=lambda: now[0], rng=random.Random(3))
    return driver, state, transport, metrics


async def run(
    runner: AttemptDriver, body: ReplayBody | None = None, trace: RouteTrace | None = None, **kw: object
) -> Passthrough | LocalFailure:
    replay = body or ReplayBody(chunks(b"hello"), 1000)
    request = make_request(received_at=10.0, definition=DEFINITION, **kw)
    return await runner.run(request, "POST", "/v1/chat/completions?x=1", CIMultiDict(), replay, trace)


def value(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"routing_key": "", "model": "m", **labels}) or 0.0


def test_retry_signal_rules_p110() -> None:
    def hdr(d: dict[str, str]):  # type: ignore[no-untyped-def]
        return lambda name: d.get(name)

    yes = {"x-stargate-retryable": "TRUE", "x-stargate-retry-reason": " queue_estimate_mismatch "}
    sig = retry_signal(429, hdr(yes), True)
    assert sig.retryable and sig.reason == "queue_estimate_mismatch" and sig.release_reservation
    assert not retry_signal(503, hdr(yes), True).release_reservation
    assert not retry_signal(429, hdr({}), True).retryable
    assert retry_signal(503, hdr({}), False).retryable
    assert retry_signal(503, hdr({}), False).reason == "retryable_upstream_response"
    assert not retry_signal(503, hdr({"x-stargate-retryable": "false"}), False).retryable
    assert not retry_signal(400, hdr({"x-stargate-retryable": "true"}), False).retryable


def test_a_retryable_refusal_carries_when_to_try_again() -> None:
    def after(value: str, retryable: str = "true") -> int | None:
        headers = {"x-stargate-retryable": retryable, "x-stargate-retry-after-ms": value}
        return retry_signal(503, headers.get, True).retry_after_ms

    assert (after("2500"), after("0"), after("soon"), after("3600001")) == (2500, 0, None, None)
    assert after("2500", retryable="false") is None  # relayed as it is


async def test_p108_retryable_429_retries_other_cluster() -> None:
    runner, state, transport, metrics = make_runner(
        {"c1": ["r"], "c2": ["ok"]}, {"r": [retryable()], "ok": [FakeResponse(200)]}
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "ok"
    assert value(metrics, "stargate_proxy_retries_total", reason="upstream_admission_rejected") == 1
    assert (
        value(metrics, "stargate_proxy_attempts_total", inference_server_id="r", result="upstream_429") == 1
    )
    assert (
        value(metrics, "stargate_proxy_attempts_total", inference_server_id="ok", result="upstream_200") == 1
    )
    assert [s[2] for s in transport.sent] == [b"hello", b"hello"]
    assert [r[0] for r in state.reserved] == ["r", "ok"] and state.released == []


async def test_p109_zero_retry_budget_passes_429_through() -> None:
    runner, _, transport, metrics = make_runner(
        {"c1": ["r"], "c2": ["ok"]}, {"r": [retryable()], "ok": [FakeResponse(200)]}
    )
    outcome = await run(runner, retry_budget_ms=0)
    assert isinstance(outcome, Passthrough) and outcome.response.status == 429
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="retry_budget_exhausted") == 1
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="upstream_admission_rejected") == 0
    assert len(transport.sent) == 1


async def test_p110_unsignalled_503_passthrough_by_default_and_retried_when_not_required() -> None:
    script: dict[str, list[FakeResponse | str]] = {"r": [FakeResponse(503)], "ok": [FakeResponse(200)]}
    runner, *_ = make_runner({"c1": ["r"], "c2": ["ok"]}, dict(script))
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.response.status == 503
    runner, _, _, metrics = make_runner(
        {"c1": ["r"], "c2": ["ok"]}, dict(script), RetrySettings(require_pylon_retry_signal=False)
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.response.status == 200
    assert value(metrics, "stargate_proxy_retries_total", reason="retryable_upstream_response") == 1


async def test_only_a_relayed_answer_below_500_shows_the_backend_alive_to_its_health_checks() -> None:
    runner, state, *_ = make_runner({"c1": ["r"]}, {"r": [FakeResponse(503), FakeResponse(400)]})
    assert isinstance(await run(runner), Passthrough)  # a Pylon whose engine is down answers at once
    assert isinstance(await run(runner), Passthrough)
    assert state.first_bytes == [(0, False), (1, True)]


CREATED = b'event: response.created\ndata: {"type":"response.created"}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
EVENTS = {"content-type": "text/event-stream"}


async def relayed_until_prefilled(path: str, response: FakeResponse) -> list[int]:
    """How many chunks of ``response`` the client had been sent when the prefill ended."""
    runner, state, *_ = make_runner({"c1": ["r"]}, {"r": [response]})
    request = make_request(received_at=10.0, definition=DEFINITION)
    outcome = await runner.run(request, "POST", path, CIMultiDict(), ReplayBody(chunks(b"{}"), 1000))
    assert isinstance(outcome, Passthrough) and outcome.first is not None
    sent = [len(state.prefills)]
    async for _ in outcome.rest:
        sent.append(len(state.prefills))
    return sent


async def test_a_responses_stream_ends_its_prefill_at_its_first_output_event() -> None:
    """An engine sends ``response.created`` as it takes the request, before its prefill."""
    stream = FakeResponse(200, EVENTS, CREATED, more=(DELTA[:20], DELTA[20:], DELTA))
    assert await relayed_until_prefilled("/v1/responses", stream) == [0, 0, 1, 1]
    at_once = FakeResponse(200, EVENTS, CREATED + DELTA, more=(DELTA,))
    assert await relayed_until_prefilled("/v1/responses?x=1", at_once) == [1, 1]
    for other in (
        ("/v1/chat/completions", FakeResponse(200, EVENTS, b'data: {"choices":[]}\n\n', more=(DELTA,))),
        ("/v1/responses", FakeResponse(200, {"content-type": "application/json"}, b"{}", more=(b"{}",))),
        ("/v1/responses", FakeResponse(400, EVENTS, CREATED, more=(CREATED,))),
    ):  # their first byte is their first token, or no token comes
        assert await relayed_until_prefilled(*other) == [1, 1]


async def test_p111_request_retry_limit_returns_last_rejection() -> None:
    runner, _, _, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"], "c3": ["c"]},
        {"a": [retryable()], "b": [retryable()], "c": [FakeResponse(200)]},
        RetrySettings(max_request_retries=1),
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough)
    assert outcome.backend.inference_server_id == "b" and outcome.response.status == 429
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="upstream_admission_rejected") == 1


async def test_p112_single_rejecting_backend_ends_503_no_eligible_backend() -> None:
    runner, _, _, metrics = make_runner({"c1": ["r"]}, {"r": [retryable()]})
    outcome = await run(runner)
    assert isinstance(outcome, LocalFailure) and (outcome.status, outcome.backend_id) == (503, "")
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="no_eligible_backend") == 1


async def test_p113_queue_mismatch_releases_reservation_and_fails_over() -> None:
    runner, state, _, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"]},
        {"a": [retryable(reason="queue_estimate_mismatch")], "b": [FakeResponse(200)]},
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    assert state.released == [0]
    assert value(metrics, "stargate_proxy_retries_total", reason="queue_estimate_mismatch") == 1


async def test_p114_queue_mismatch_tries_sibling_in_same_cluster_first() -> None:
    runner, _, _, metrics = make_runner(
        {"c1": ["a", "b"], "c2": ["z"]},
        {
            "a": [retryable(reason="queue_estimate_mismatch")],
            "b": [FakeResponse(200)],
            "z": [FakeResponse(200)],
        },
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    labels = {"algorithm": "round-robin", "selection": "primary"}
    assert value(metrics, "stargate_routing_selections_total", **labels) == 1


async def test_other_reason_excludes_whole_cluster() -> None:
    runner, *_ = make_runner(
        {"c1": ["a", "b"], "c2": ["z"]},
        {"a": [retryable()], "b": [FakeResponse(200)], "z": [FakeResponse(200)]},
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "z"


async def test_p116_no_connect_retries_gives_502_without_reconnect() -> None:
    runner, _, _, metrics = make_runner({"c1": ["a"]}, {"a": [DEAD]}, RetrySettings(max_connect_retries=0))
    outcome = await run(runner)
    assert isinstance(outcome, LocalFailure) and (outcome.status, outcome.backend_id) == (502, "a")
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="connect_retries_exhausted") == 1
    reconnects = metrics.registry.get_sample_value(
        "stargate_quic_hot_path_reconnect_total", {"inference_server_id": "a", "result": "error"}
    )
    assert reconnects is None
    assert value(metrics, "stargate_proxy_attempts_total", inference_server_id="a", result="proxy_502") == 1


async def test_p117_unreachable_backend_fails_over_to_sibling() -> None:
    runner, _, transport, metrics = make_runner(
        {"c1": ["a", "b"], "c2": ["z"]}, {"a": [DEAD], "b": [FakeResponse(200)], "z": [FakeResponse(200)]}
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    assert value(metrics, "stargate_proxy_retries_total", reason="connect_failover") == 1
    assert transport.sent[0][2] == b"hello"  # the unconsumed body was streamed on the retry


async def test_p115_reconnect_success_retries_same_backend() -> None:
    runner, _, _, metrics = make_runner(
        {"c1": ["a", "b"]}, {"a": [DEAD, FakeResponse(200)], "b": [FakeResponse(200)]}, reconnects={"a": True}
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "a"
    assert value(metrics, "stargate_proxy_retries_total", reason="hot_path_reconnect") == 1
    ok = metrics.registry.get_sample_value(
        "stargate_quic_hot_path_reconnect_total", {"inference_server_id": "a", "result": "success"}
    )
    assert ok == 1


async def test_all_backends_dead_ends_502_after_connect_retries() -> None:
    runner, _, _, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"], "c3": ["c"]}, {"a": [DEAD], "b": [DEAD], "c": [DEAD]}
    )
    outcome = await run(runner)
    assert isinstance(outcome, LocalFailure) and (outcome.status, outcome.backend_id) == (502, "c")
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="connect_retries_exhausted") == 1


async def test_proxy_error_with_spent_budget_is_502_budget_exhausted() -> None:
    runner, _, _, metrics = make_runner({"c1": ["a", "b"]}, {"a": [DEAD], "b": [FakeResponse(200)]})
    outcome = await run(runner, retry_budget_ms=0)
    assert isinstance(outcome, LocalFailure) and outcome.status == 502
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="retry_budget_exhausted") == 1


async def test_incomplete_body_is_not_retried() -> None:
    runner, *_ = make_runner({"c1": ["a", "b"]}, {"a": [HALF], "b": [FakeResponse(200)]})
    body = ReplayBody(chunks(b"he", b"llo"), 1000)
    outcome = await run(runner, body)
    assert isinstance(outcome, LocalFailure) and outcome.status == 502
    assert body.readiness() is Readiness.INCOMPLETE


async def test_p107_retry_needing_overflowed_body_is_413_with_backend_id() -> None:
    runner, *_ = make_runner({"c1": ["a"], "c2": ["b"]}, {"a": [retryable()], "b": [FakeResponse(200)]})
    body = ReplayBody(chunks(b"12345", b"67890", b"abcde"), 8)
    outcome = await run(runner, body)
    assert isinstance(outcome, LocalFailure) and (outcome.status, outcome.backend_id) == (413, "a")


async def test_a_body_the_router_had_no_room_to_keep_gets_the_backends_answer_not_a_retry() -> None:
    runner, _, transport, _ = make_runner(
        {"c1": ["a"], "c2": ["b"]}, {"a": [retryable()], "b": [FakeResponse(200)]}
    )
    budget = BodyBudget(6, 1.0)
    body = ReplayBody(chunks(b"12345", b"67890"), 1000, budget)
    outcome = await run(runner, body)
    assert isinstance(outcome, Passthrough) and outcome.response.status == 429  # not a 413
    assert outcome.backend.inference_server_id == "a" and len(transport.sent) == 1
    assert budget.used == 0  # the 5 bytes kept before room ran out went back with the buffer


async def test_expected_queue_header_set_per_cluster_and_absent_when_unknown_p104() -> None:
    runner, _, transport, _ = make_runner(
        {"c1": ["a"], "c2": ["b"]},
        {"a": [retryable()], "b": [FakeResponse(200)]},
        expected={"c1": 42, "c2": None},
    )
    await run(runner)
    assert transport.sent[0][1].get("x-stargate-expected-queue-ms") == "42"
    assert "x-stargate-expected-queue-ms" not in transport.sent[1][1]


async def test_routing_duration_observed_once_per_request_p127() -> None:
    runner, _, _, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"]}, {"a": [retryable()], "b": [FakeResponse(200)]}
    )
    await run(runner)
    assert value(metrics, "stargate_routing_duration_seconds_count") == 1
    assert value(metrics, "stargate_proxy_duration_seconds_count", inference_server_id="b") == 1


async def test_p127_durations_measure_the_routing_wait_and_the_time_to_the_answer() -> None:
    """Counted only, a duration recorded as zero went unseen."""
    now = [10.0]

    async def sleep(seconds: float) -> None:  # the routing wait for room passes on the clock
        now[0] += seconds

    class Slow(FakeTransport):
        async def send(
            self,
            backend: FakeBackend,
            method: str,
            path_qs: str,
            headers: CIMultiDict[str],
            body: bytes | AsyncIterable[bytes],
        ) -> FakeResponse:
            now[0] += 0.25  # the backend answers after 250 ms
            return await super().send(backend, method, path_qs, headers, body)

    policy = ScriptedPolicy([UNAVAILABLE, Selected(Choice(0))])
    state = FakeState(make_view({"c1": ["b"]}, policy))
    machine = AttemptMachine(
        RetrySettings(), admission=lambda d, c, r: None, expected_queue=lambda c, p, a: None
    )
    metrics = RouterMetrics()
    transport = Slow({"b": [FakeResponse(200)]})
    driver = AttemptDriver(state, machine, transport, metrics, clock=lambda: now[0], sleep=sleep)
    await run(driver, max_wait_ms=1000)
    waited = now[0] - 10.0 - 0.25
    assert 0 < waited < 1.0
    assert value(metrics, "stargate_routing_duration_seconds_sum") == pytest.approx(waited)
    proxied = value(metrics, "stargate_proxy_duration_seconds_sum", inference_server_id="b")
    assert proxied == pytest.approx(waited + 0.25)  # from the request's arrival to the answer's head


async def test_header_timeout_fails_over_to_a_sibling_without_reconnecting() -> None:
    runner, _, transport, metrics = make_runner(
        {"c1": ["a", "b"], "c2": ["z"]},
        {"a": [HUNG, FakeResponse(200)], "b": [FakeResponse(200)], "z": [FakeResponse(200)]},
        reconnects={"a": True},
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    assert [s[0] for s in transport.sent] == ["b"]  # a is never sent the request again
    assert value(metrics, "stargate_proxy_retries_total", reason="connect_failover") == 1
    assert value(metrics, "stargate_proxy_retries_total", reason="hot_path_reconnect") == 0
    reconnects = metrics.registry.get_sample_value(
        "stargate_quic_hot_path_reconnect_total", {"inference_server_id": "a", "result": "success"}
    )
    assert reconnects is None


async def test_header_timeout_without_sibling_moves_to_another_cluster() -> None:
    runner, *_ = make_runner({"c1": ["a"], "c2": ["z"]}, {"a": [HUNG], "z": [FakeResponse(200)]})
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "z"


async def test_refused_backend_with_failed_reconnect_moves_to_another_cluster() -> None:
    runner, _, _, metrics = make_runner({"c1": ["a"], "c2": ["z"]}, {"a": [DEAD], "z": [FakeResponse(200)]})
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "z"
    evictions = metrics.registry.get_sample_value(
        "stargate_quic_connection_evictions_total", {"inference_server_id": "a", "reason": "proxy_error"}
    )
    assert evictions == 1


async def test_a_released_rejection_is_not_relayed() -> None:
    first = retryable()
    runner, *_ = make_runner({"c1": ["r"], "c2": ["ok"]}, {"r": [first], "ok": [FakeResponse(200)]})
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.response.status == 200 and first.released


async def test_transport_failure_answer_names_the_backend_and_code() -> None:
    runner, *_ = make_runner({"c1": ["a"]}, {"a": [DEAD]}, RetrySettings(max_connect_retries=0))
    outcome = await run(runner)
    assert isinstance(outcome, LocalFailure) and outcome.error.code == "upstream_transport_error"


async def test_a_body_broken_before_its_first_byte_is_retried_on_another_backend() -> None:
    broken = FakeResponse(200, broken=True)
    runner, state, transport, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"]}, {"a": [broken], "b": [FakeResponse(200, body=b"whole")]}
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    assert outcome.first == b"whole" and [chunk async for chunk in outcome.rest] == []
    assert broken.released and state.finished == [0]  # the broken attempt left the in-flight count
    assert [sent[0] for sent in transport.sent] == ["a", "b"]
    assert value(metrics, "stargate_proxy_retries_total", reason="connect_failover") == 1


async def test_a_body_broken_before_its_first_byte_with_nowhere_else_is_an_error_answer() -> None:
    """Not a cut stream: the client has received nothing, so Stargate answers it (as after a header
    timeout, the backend is not tried again) with the failure that happened, not a 503."""
    runner, state, transport, metrics = make_runner({"c1": ["a"]}, {"a": [FakeResponse(200, broken=True)]})
    outcome = await run(runner)
    assert isinstance(outcome, LocalFailure) and (outcome.status, outcome.backend_id) == (502, "a")
    assert outcome.error.code == "upstream_transport_error"
    assert len(transport.sent) == 1 and state.finished == [0]
    assert value(metrics, "stargate_proxy_retry_exhausted_total", reason="no_eligible_backend") == 1


@pytest.mark.parametrize("waits_for", ["response headers", "the first body byte"])
async def test_a_request_cancelled_while_it_waits_for_its_backend_leaves_the_in_flight_count(
    waits_for: str,
) -> None:
    """The client hung up (aiohttp cancels its handler) while the backend had not answered. The
    request is counted at that backend, and the attempt too: 24 of 30 were counted."""
    first_byte = FakeResponse(200, hold=asyncio.Event())
    step = SILENT if waits_for == "response headers" else first_byte
    runner, state, transport, metrics = make_runner({"c1": ["a"]}, {"a": [step]})
    trace = RouteTrace()
    task = asyncio.create_task(run(runner, trace=trace))
    while not transport.sent:
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert state.finished == [0]
    assert first_byte.released is (step is first_byte)
    assert trace.at_backend == "a"
    result = "proxy_499" if step == SILENT else "upstream_200"
    assert value(metrics, "stargate_proxy_attempts_total", inference_server_id="a", result=result) == 1


async def test_a_request_cancelled_while_routed_again_is_at_no_backend() -> None:
    """Refused by its backend and waiting for room elsewhere: the hang-up is counted at none."""
    policy = ScriptedPolicy([Selected(Choice(0)), UNAVAILABLE])
    state = FakeState(make_view({"c1": ["a"], "c2": ["b"]}, policy))
    settings = RetrySettings()
    machine = AttemptMachine(settings, admission=lambda d, c, r: None, expected_queue=lambda c, p, a: None)

    async def sleep(_seconds: float) -> None:  # the client hangs up during the routing wait
        raise asyncio.CancelledError

    metrics = RouterMetrics()
    transport = FakeTransport({"a": [retryable(reason="other")]})
    driver = AttemptDriver(state, machine, transport, metrics, clock=lambda: 10.0, sleep=sleep)
    trace = RouteTrace()
    with pytest.raises(asyncio.CancelledError):
        await run(driver, trace=trace, max_wait_ms=1000)
    assert trace.backend_id == "a" and trace.at_backend == ""
    refused = value(metrics, "stargate_proxy_attempts_total", inference_server_id="a", result="upstream_429")
    assert refused == 1


async def test_every_ended_attempt_finishes_and_the_final_one_is_left_to_the_relay() -> None:
    """The in-flight count must drop each attempt that ended (refused, unreachable) at once; the
    attempt whose answer is relayed stays in flight until the relay reports its end."""
    runner, state, _, _ = make_runner(
        {"c1": ["a", "b"], "c2": ["r"], "c3": ["ok"]},
        {"a": [DEAD], "b": [retryable(reason="other")], "r": [retryable()], "ok": [FakeResponse(200)]},
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "ok"
    assert state.finished == [0, 1, 2]
    runner.finish(outcome)
    assert state.finished == [0, 1, 2, 3]


async def test_a_request_arriving_while_the_router_holds_its_limit_gets_503_the_held_one_goes_on() -> None:
    policy = ScriptedPolicy([UNAVAILABLE, UNAVAILABLE, Selected(Choice(0))])
    state = FakeState(make_view({"c1": ["b1"]}, policy))
    settings = RetrySettings(max_held_requests=1)
    machine = AttemptMachine(settings, admission=lambda d, c, r: None, expected_queue=lambda c, p, a: None)
    arrived: list[Passthrough | LocalFailure] = []

    async def sleep(_seconds: float) -> None:  # while the first request is held, a second arrives
        if not arrived:
            arrived.append(await run(driver, max_wait_ms=1000))

    transport = FakeTransport({"b1": [FakeResponse(200)]})
    driver = AttemptDriver(state, machine, transport, RouterMetrics(), clock=lambda: 10.0, sleep=sleep)
    held = await run(driver, max_wait_ms=1000)
    assert isinstance(held, Passthrough) and held.response.status == 200
    (second,) = arrived
    assert isinstance(second, LocalFailure) and second.status == 503
    assert str(second.error) == "the router already holds 1 waiting requests (--max-held-requests)"


@pytest.mark.parametrize(
    ("step", "body", "counted"),
    [
        (DEAD, None, []),  # a connection this router could not get says nothing of the backend
        (HUNG, None, []),  # nor a wait for headers it gave up on
        (HALF, ReplayBody(chunks(b"he", b"llo"), 1000), []),  # nor a body cut before it was whole
        (FakeResponse(200, broken=True), None, ["a"]),  # an answer broken before its first byte
    ],
)
async def test_only_a_backends_own_failures_count_toward_its_server_error_hold(
    step: FakeResponse | str, body: ReplayBody | None, counted: list[str]
) -> None:
    runner, state, _, _ = make_runner({"c1": ["a"]}, {"a": [step]}, RetrySettings(max_connect_retries=0))
    await run(runner, body)
    assert state.server_errors == counted


@pytest.mark.parametrize(
    ("response", "cut", "failed", "answered"),
    [
        (FakeResponse(200), False, [], ["a"]),
        (FakeResponse(400), False, [], ["a"]),  # the client's mistake
        (FakeResponse(200), True, ["a"], []),  # cut by the backend after its first byte
        (FakeResponse(500), False, ["a"], []),
        (FakeResponse(429), False, ["a"], []),  # a refusal it gives every request, at once
        (retryable(), False, [], []),  # relayed once retries ran out: busy, not broken
        (retryable(503, "busy"), False, [], []),  # a 503 so (a budget of 0): not a server error
    ],
)
async def test_the_relays_end_tells_whether_the_backend_failed_the_answer(
    response: FakeResponse, cut: bool, failed: list[str], answered: list[str]
) -> None:
    runner, state, _, _ = make_runner({"c1": ["a"]}, {"a": [response]}, RetrySettings(max_request_retries=0))
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and state.server_errors == []  # none before the end
    runner.finish(outcome, cut)
    assert (state.server_errors, state.answers, state.finished) == (failed, answered, [0])


async def test_a_backend_that_drops_the_request_again_on_a_fresh_connection_is_failed_over() -> None:
    """The hot-path reconnect resends once on a fresh connection; failing again there, the backend
    is what drops it, not a stale connection: the request goes to another backend."""
    runner, state, transport, metrics = make_runner(
        {"c1": ["a"], "c2": ["b"]}, {"a": [DROP], "b": [FakeResponse(200)]}, reconnects={"a": True}
    )
    outcome = await run(runner)
    assert isinstance(outcome, Passthrough) and outcome.backend.inference_server_id == "b"
    assert [sent[0] for sent in transport.sent] == ["a", "a", "b"]
    assert state.server_errors == ["a", "a"]
    assert value(metrics, "stargate_proxy_retries_total", reason="hot_path_reconnect") == 1
    assert value(metrics, "stargate_proxy_retries_total", reason="connect_failover") == 1
