"""Attempt execution and retry rules (§4.8) through a fake transport and fake routing state."""

from __future__ import annotations

import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Set
from dataclasses import dataclass, field

from multidict import CIMultiDict

from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Policy
from stargate.balancer.types import Candidate, Choice, Decision, LbRequest, ModelStats, Selected, Target
from stargate.errors import UpstreamError
from stargate.router.headers import ProxyRequest
from stargate.router.metrics import RouterMetrics
from stargate.router.replay import Readiness, ReplayBody
from stargate.router.retries import AttemptRunner, LocalFailure, Passthrough, RetrySettings, retry_signal
from stargate.router.routing import Router

TARGET = Target(None, "m")
DEFINITION = AlgorithmDefinition(Algorithm.ROUND_ROBIN)


@dataclass(frozen=True)
class FakeBackend:
    inference_server_id: str
    url: str
    cluster_id: str


class FirstEligible:
    """Picks the first non-excluded candidate, like a deterministic balancer."""

    definition = DEFINITION

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        for i, c in enumerate(candidates):
            if c.cluster_id not in request.excluded:
                return Selected(Choice(i))
        raise AssertionError("the routing loop must not call the policy with everything excluded")


@dataclass
class FakeView:
    clusters: dict[str, list[str]]
    expected: dict[str, int | None]

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(
            Candidate(c, ModelStats(queue_time_estimate_ms_by_priority={0: self.expected[c] or 0}), 0.001)
            for c in self.clusters
        )

    def policy(self, definition: AlgorithmDefinition) -> Policy:
        return FirstEligible()

    def pick_backend(self, cluster_id: str, failed_backend_ids: Set[str]) -> FakeBackend | None:
        for b in self.clusters.get(cluster_id, []):
            if b not in failed_backend_ids:
                return FakeBackend(b, f"http://{b}", cluster_id)
        return None


@dataclass
class FakeState:
    view_obj: FakeView
    reserved: list[tuple[str, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)

    def view(self, target: Target) -> FakeView:
        return self.view_obj

    def is_advertised(self, target: Target) -> bool:
        return True

    def reserve(self, target: Target, backend_id: str, input_tokens: int, priority: int) -> int:
        self.reserved.append((backend_id, input_tokens))
        return len(self.reserved) - 1

    def release(self, reservation: int) -> None:
        self.released.append(reservation)

    def first_byte(self, reservation: int) -> None:
        pass

    def finish(self, reservation: int) -> None:
        self.finished.append(reservation)


@dataclass
class FakeResponse:
    status: int
    extra: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    released: bool = False
    reason: str | None = None

    @property
    def headers(self) -> Iterable[tuple[str, str]]:
        return self.extra.items()

    def header(self, name: str) -> str | None:
        return {k.lower(): v for k, v in self.extra.items()}.get(name.lower())

    async def chunks(self) -> AsyncIterator[bytes]:
        yield self.body

    def complete(self) -> bool:
        return True

    def release(self) -> None:
        self.released = True


DEAD = "dead"  # script entry: raise before reading the body
HALF = "half"  # script entry: read one chunk of the body, then fail


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
            raise UpstreamError("connection refused")
        data = bytearray()
        if isinstance(body, bytes):
            data.extend(body)
        else:
            async for chunk in body:
                data.extend(chunk)
                if step == HALF:
                    raise UpstreamError("reset mid-body")
        self.sent.append((backend.inference_server_id, headers, bytes(data)))
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
) -> tuple[AttemptRunner, FakeState, FakeTransport, RouterMetrics]:
    state = FakeState(FakeView(clusters, expected or dict.fromkeys(clusters, 0)))
    metrics = RouterMetrics()
    router = Router(
        state,
        metrics,
        admission=lambda d, c, r: None,
        expected_queue=lambda stats, p: stats.queue_time_estimate_ms_by_priority.get(0) or None,
    )
    transport = FakeTransport(script, reconnects or {})
    runner = AttemptRunner(state, router, transport, metrics, settings or RetrySettings(), clock=lambda: 10.0)
    return runner, state, transport, metrics


def make_request(**kw: object) -> ProxyRequest:
    fields: dict[str, object] = {
        "request_id": "r1",
        "target": TARGET,
        "input_tokens": 10,
        "definition": DEFINITION,
        "requested_method": None,
        "priority": 0,
        "max_wait_ms": None,
        "request_slo_ms": None,
        "cache_affinity_key": None,
        "retry_budget_ms": None,
        "received_at": 10.0,
    }
    fields.update(kw)
    return ProxyRequest(**fields)  # type: ignore[arg-type]


async def run(
    runner: AttemptRunner, body: ReplayBody | None = None, **kw: object
) -> Passthrough | LocalFailure:
    replay = body or ReplayBody(chunks(b"hello"), 1000)
    return await runner.run(make_request(**kw), "POST", "/v1/chat/completions?x=1", CIMultiDict(), replay)


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
