"""The routing loop against in-memory fakes: scripted decisions, a fake clock and sleep."""

from __future__ import annotations

import random
from collections.abc import Set
from dataclasses import dataclass, field

from stargate.balancer.estimates import effective_queue_ms
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import (
    UNAVAILABLE,
    Candidate,
    Choice,
    Decision,
    LbRequest,
    ModelStats,
    Selected,
    Target,
    Wait,
)
from stargate.router.headers import ProxyRequest
from stargate.router.metrics import RouterMetrics
from stargate.router.routing import RequestProgress, Routed, Router, RoutingFailed

TARGET = Target(None, "m")


@dataclass(frozen=True)
class FakeBackend:
    inference_server_id: str
    url: str
    cluster_id: str


@dataclass
class FakePolicy:
    definition: AlgorithmDefinition
    script: list[Decision]
    seen: list[LbRequest] = field(default_factory=list)

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        self.seen.append(request)
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


@dataclass
class FakeView:
    candidates: tuple[Candidate, ...]
    policy_obj: FakePolicy
    backends: dict[str, list[FakeBackend]]

    def policy(self, definition: AlgorithmDefinition) -> FakePolicy:
        return self.policy_obj

    def pick_backend(self, cluster_id: str, failed_backend_ids: Set[str]) -> FakeBackend | None:
        eligible = [
            b for b in self.backends.get(cluster_id, []) if b.inference_server_id not in failed_backend_ids
        ]
        return eligible[0] if eligible else None


@dataclass
class FakeState:
    current: FakeView | None
    advertised: bool = True

    def view(self, target: Target) -> FakeView | None:
        return self.current

    def is_advertised(self, target: Target) -> bool:
        return self.advertised


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


def make_candidate(cluster_id: str, **stats: float) -> Candidate:
    return Candidate(cluster_id=cluster_id, stats=ModelStats(**stats), rtt_s=0.001)  # type: ignore[arg-type]


def make_setup(
    script: list[Decision],
    clusters: tuple[str, ...] = ("c1",),
    definition: AlgorithmDefinition | None = None,
    admission: str | None = None,
    candidates: tuple[Candidate, ...] | None = None,
) -> tuple[Router, FakeState, FakeClock, RouterMetrics, FakePolicy]:
    definition = definition or AlgorithmDefinition(Algorithm.POWER_OF_N)
    policy = FakePolicy(definition, list(script))
    cands = candidates if candidates is not None else tuple(make_candidate(c) for c in clusters)
    backends = {
        c.cluster_id: [FakeBackend(f"{c.cluster_id}-b", f"http://{c.cluster_id}", c.cluster_id)]
        for c in cands
    }
    state = FakeState(FakeView(cands, policy, backends))
    clock = FakeClock()
    metrics = RouterMetrics()
    router = Router(
        state,
        metrics,
        admission=lambda d, c, r: admission,
        expected_queue=effective_queue_ms,
        clock=clock,
        sleep=clock.sleep,
        rng=random.Random(7),
    )
    return router, state, clock, metrics, policy


def make_request(
    clock: FakeClock, definition: AlgorithmDefinition | None = None, **kw: object
) -> ProxyRequest:
    fields: dict[str, object] = {
        "request_id": "r1",
        "target": TARGET,
        "input_tokens": 10,
        "definition": definition or AlgorithmDefinition(Algorithm.POWER_OF_N),
        "requested_method": None,
        "priority": 0,
        "max_wait_ms": None,
        "request_slo_ms": None,
        "cache_affinity_key": None,
        "retry_budget_ms": None,
        "received_at": clock.now,
    }
    fields.update(kw)
    return ProxyRequest(**fields)  # type: ignore[arg-type]


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


SELECT0 = Selected(Choice(0))


async def test_selected_routes_to_backend_and_counts_primary_selection_p127() -> None:
    router, _, clock, metrics, _ = make_setup([SELECT0])
    result = await router.route(make_request(clock), RequestProgress())
    assert isinstance(result, Routed)
    assert result.backend.inference_server_id == "c1-b"
    assert clock.sleeps == []
    labels = {"routing_key": "", "model": "m", "algorithm": "power-of-n", "selection": "primary"}
    assert sample(metrics, "stargate_routing_selections_total", **labels) == 1


async def test_rank_depth_two_counts_fallback_and_kv_flag() -> None:
    router, _, clock, metrics, _ = make_setup(
        [Selected(Choice(0, rank_depth=2, selected_after_kv_free_tokens_skip=True))]
    )
    await router.route(make_request(clock), RequestProgress())
    labels = {"routing_key": "", "model": "m", "algorithm": "power-of-n"}
    assert sample(metrics, "stargate_routing_selections_total", **labels, selection="fallback") == 1
    assert sample(metrics, "stargate_routing_kv_free_token_fallback_selections_total", **labels) == 1


async def test_p139_wait_sleeps_at_most_25ms_then_routes_on_fresh_snapshot() -> None:
    router, _, clock, _, policy = make_setup([Wait(200.0), Wait(175.0), SELECT0])
    progress = RequestProgress()
    result = await router.route(make_request(clock), progress)
    assert isinstance(result, Routed)
    assert clock.sleeps == [0.025, 0.025]
    assert progress.routing_retry_attempts == 2
    assert [round(r.elapsed_ms) for r in policy.seen] == [0, 25, 50]


async def test_p149_wait_hint_shorter_than_cap_is_honoured() -> None:
    router, _, clock, _, _ = make_setup([Wait(10.0), SELECT0])
    await router.route(make_request(clock), RequestProgress())
    assert clock.sleeps == [0.010]


async def test_p142_timed_wait_without_max_wait_header_uses_arrival_plus_60s() -> None:
    router, _, clock, _, _ = make_setup([Wait(1000.0)])
    result = await router.route(make_request(clock), RequestProgress())
    assert result == RoutingFailed(503)
    assert abs(sum(clock.sleeps) - 60.0) < 1e-6
    assert max(clock.sleeps) <= 0.025


async def test_p143_max_wait_shorter_than_affinity_wait_ends_with_503() -> None:
    router, _, clock, _, _ = make_setup([Wait(200.0)])
    result = await router.route(make_request(clock, max_wait_ms=50), RequestProgress())
    assert result == RoutingFailed(503)
    assert abs(sum(clock.sleeps) - 0.050) < 1e-9


async def test_p122_unavailable_without_max_wait_fails_immediately() -> None:
    router, _, clock, _, policy = make_setup([UNAVAILABLE])
    result = await router.route(make_request(clock), RequestProgress())
    assert result == RoutingFailed(503)
    assert clock.sleeps == [] and len(policy.seen) == 1


async def test_p122_unavailable_polls_1_to_9ms_until_capped_deadline() -> None:
    router, _, clock, _, _ = make_setup([UNAVAILABLE])
    progress = RequestProgress()
    result = await router.route(make_request(clock, max_wait_ms=60_000), progress)
    assert result == RoutingFailed(503)
    assert abs(sum(clock.sleeps) - 60.0) < 1e-6
    assert all(s <= 0.009 + 1e-12 for s in clock.sleeps)
    assert all(s >= 0.001 - 1e-12 for s in clock.sleeps[:-1])
    assert progress.routing_retry_attempts == len(clock.sleeps)


async def test_unavailable_then_selected_within_max_wait() -> None:
    router, _, clock, _, _ = make_setup([UNAVAILABLE, UNAVAILABLE, SELECT0])
    result = await router.route(make_request(clock, max_wait_ms=250), RequestProgress())
    assert isinstance(result, Routed)
    assert len(clock.sleeps) == 2


async def test_p148_every_candidate_excluded_finalizes_without_waiting() -> None:
    router, _, clock, _, policy = make_setup([Wait(200.0)], clusters=("c1", "c2"))
    progress = RequestProgress(failed_cluster_ids={"c1", "c2"})
    result = await router.route(make_request(clock, max_wait_ms=1000), progress)
    assert result == RoutingFailed(503, exhausted=True)
    assert clock.sleeps == [] and policy.seen == []


async def test_exclusions_are_passed_to_the_policy() -> None:
    router, _, clock, _, policy = make_setup([Selected(Choice(1))], clusters=("c1", "c2"))
    result = await router.route(make_request(clock), RequestProgress(failed_cluster_ids={"c1"}))
    assert isinstance(result, Routed) and result.backend.cluster_id == "c2"
    assert policy.seen[0].excluded == frozenset({"c1"})


async def test_p101_unknown_target_is_404_no_eligible_candidates() -> None:
    router, state, clock, _, _ = make_setup([SELECT0])
    state.current, state.advertised = None, False
    result = await router.route(make_request(clock, max_wait_ms=1000), RequestProgress())
    assert result == RoutingFailed(404, "no_eligible_candidates")
    assert clock.sleeps == []


async def test_p120_advertised_but_inactive_target_is_plain_503() -> None:
    router, state, clock, _, _ = make_setup([SELECT0])
    state.current = None
    assert await router.route(make_request(clock), RequestProgress()) == RoutingFailed(503)


async def test_target_gone_after_failures_is_503_not_404() -> None:
    router, state, clock, _, _ = make_setup([SELECT0])
    state.current, state.advertised = None, False
    progress = RequestProgress(failed_backend_ids={"x"})
    assert await router.route(make_request(clock), progress) == RoutingFailed(503, exhausted=True)


async def test_cluster_without_eligible_backend_is_excluded_and_rerouted_p90() -> None:
    cands = (make_candidate("c1"), make_candidate("c2"))
    router, _, clock, metrics, policy = make_setup([SELECT0, Selected(Choice(1))], candidates=cands)
    progress = RequestProgress(failed_backend_ids={"c1-b"})
    result = await router.route(make_request(clock), progress)
    assert isinstance(result, Routed) and result.backend.inference_server_id == "c2-b"
    assert progress.failed_cluster_ids == {"c1"}
    assert policy.seen[1].excluded == frozenset({"c1"})
    labels = {"routing_key": "", "model": "m", "algorithm": "power-of-n", "selection": "primary"}
    assert sample(metrics, "stargate_routing_selections_total", **labels) == 1


async def test_p118_admission_rejection_is_503_with_code_and_counted() -> None:
    definition = AlgorithmDefinition(Algorithm.POWER_OF_N, max_input_work_seconds=0.5)
    router, _, clock, metrics, policy = make_setup(
        [SELECT0], definition=definition, admission="input_work_limit_exceeded"
    )
    result = await router.route(make_request(clock, definition=definition), RequestProgress())
    assert result == RoutingFailed(503, "input_work_limit_exceeded")
    assert policy.seen == []
    labels = {"routing_key": "", "model": "m", "reason": "input_work_limit_exceeded"}
    assert sample(metrics, "stargate_admission_rejections_total", **labels) == 1


async def test_p118_admission_configured_unknown_model_still_404() -> None:
    definition = AlgorithmDefinition(Algorithm.POWER_OF_N, max_input_work_seconds=0.5)
    router, state, clock, _, _ = make_setup(
        [SELECT0], definition=definition, admission="input_work_capacity_unavailable"
    )
    state.current, state.advertised = None, False
    result = await router.route(make_request(clock, definition=definition), RequestProgress())
    assert result == RoutingFailed(404, "no_eligible_candidates")


async def test_admission_not_consulted_without_limit() -> None:
    router, _, clock, _, _ = make_setup([SELECT0], admission="input_work_limit_exceeded")
    assert isinstance(await router.route(make_request(clock), RequestProgress()), Routed)


async def test_p27_expected_queue_uses_free_slot_rule() -> None:
    busy = make_candidate(
        "c1",
        max_engine_concurrency=8,
        num_running_queries=3,
        queued_input_size=10_000,
        last_mean_input_tps=100.0,
    )
    router, _, clock, _, _ = make_setup([SELECT0], candidates=(busy,))
    result = await router.route(make_request(clock), RequestProgress())
    assert isinstance(result, Routed) and result.expected_queue_ms == 0


async def test_p28_p104_expected_queue_from_backlog_when_full_and_none_when_unknown() -> None:
    full = make_candidate(
        "c1",
        max_engine_concurrency=8,
        num_running_queries=8,
        queued_input_size=4200,
        last_mean_input_tps=100_000.0,
    )
    router, _, clock, _, _ = make_setup([SELECT0], candidates=(full,))
    result = await router.route(make_request(clock), RequestProgress())
    assert isinstance(result, Routed) and result.expected_queue_ms == 42
    unknown = make_candidate("c1", queued_input_size=5, last_mean_input_tps=0.0)
    router, _, clock, _, _ = make_setup([SELECT0], candidates=(unknown,))
    result = await router.route(make_request(clock), RequestProgress())
    assert isinstance(result, Routed) and result.expected_queue_ms is None


async def test_request_fields_reach_the_policy() -> None:
    router, _, clock, _, policy = make_setup([SELECT0])
    request = make_request(clock, priority=4, cache_affinity_key="k", request_slo_ms=900, input_tokens=33)
    await router.route(request, RequestProgress())
    seen = policy.seen[0]
    assert (seen.priority, seen.cache_affinity_key, seen.request_slo_ms, seen.input_tokens) == (
        4,
        "k",
        900,
        33,
    )
    assert seen.received_at == request.received_at
