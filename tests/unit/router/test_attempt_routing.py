"""The attempt machine's routing pass (spec §4.7), stepped by hand: no sockets, no sleeps, exact time."""

from __future__ import annotations

import dataclasses
import random

import pytest
from support.balancer_builders import make_candidate
from support.router_fakes import FakeView, ScriptedPolicy, make_request, make_view

from stargate.balancer.estimates import expected_queue_ms
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import (
    UNAVAILABLE,
    Candidate,
    Choice,
    Decision,
    InFlight,
    LbRequest,
    Selected,
    Wait,
)
from stargate.errors import InputWorkLimitExceeded, NoEligibleCandidates, RoutingError
from stargate.router.attempt import (
    AdmissionRejected,
    AttemptMachine,
    AttemptState,
    Event,
    Exhausted,
    Fail,
    NoTarget,
    Pick,
    Picked,
    RetrySettings,
    Send,
    Sleep,
    Snapshot,
    Start,
    Woke,
    start,
)
from stargate.router.headers import ProxyRequest

SELECT0 = Selected(Choice(0))


def make_machine(admission: str | None = None) -> AttemptMachine:
    return AttemptMachine(
        RetrySettings(), admission=lambda d, c, r: admission, expected_queue=expected_queue_ms
    )


def route(
    machine: AttemptMachine, state: AttemptState, snapshot: Snapshot, now: float = 100.0
) -> tuple[AttemptState, Send | Fail, list[float]]:
    """Step until the machine sends or fails; performs picks and sleeps (advancing the clock)."""
    sleeps: list[float] = []
    event: Event = Start()
    rng = random.Random(7)
    while True:
        state, action = machine.step(state, event, snapshot, now, rng)
        if isinstance(action, Send | Fail):
            return state, action, sleeps
        if isinstance(action, Sleep):
            assert action.seconds > 0
            sleeps.append(action.seconds)
            now += action.seconds
            event = Woke()
        else:
            assert isinstance(action, Pick) and not isinstance(snapshot, NoTarget)
            event = Picked(snapshot.pick_backend(action.cluster_id, action.failed_backend_ids))


def scripted(script: list[Decision], clusters: tuple[str, ...] = ("c1",)) -> tuple[FakeView, ScriptedPolicy]:
    policy = ScriptedPolicy(list(script))
    return make_view({c: [f"{c}-b"] for c in clusters}, policy), policy


def with_candidates(candidates: tuple[Candidate, ...]) -> FakeView:
    view, _ = scripted([SELECT0])
    view.candidates = candidates
    return view


def fresh(**kw: object) -> AttemptState:
    return start(make_request(**kw))


def test_selected_sends_to_the_picked_backend_with_the_choice_p127() -> None:
    view, _ = scripted([SELECT0])
    _, action, sleeps = route(make_machine(), fresh(), view)
    assert isinstance(action, Send) and action.backend.inference_server_id == "c1-b"
    assert action.choice == Choice(0) and sleeps == []


def test_the_choice_carries_rank_depth_and_kv_flag() -> None:
    choice = Choice(0, rank_depth=2, selected_after_kv_free_tokens_skip=True)
    view, _ = scripted([Selected(choice)])
    _, action, _ = route(make_machine(), fresh(), view)
    assert isinstance(action, Send) and action.choice == choice


def test_p139_wait_sleeps_at_most_25ms_then_routes_on_fresh_snapshot() -> None:
    view, policy = scripted([Wait(200.0), Wait(175.0), SELECT0])
    state, action, sleeps = route(make_machine(), fresh(), view)
    assert isinstance(action, Send)
    assert sleeps == [0.025, 0.025]
    assert state.routing_retry_attempts == 2
    assert [round(r.elapsed_ms) for r in policy.seen] == [0, 25, 50]


def test_p149_wait_hint_shorter_than_cap_is_honoured() -> None:
    view, _ = scripted([Wait(10.0), SELECT0])
    assert route(make_machine(), fresh(), view)[2] == [0.010]


def test_p142_timed_wait_without_max_wait_header_uses_arrival_plus_60s() -> None:
    view, _ = scripted([Wait(1000.0)])
    _, action, sleeps = route(make_machine(), fresh(), view)
    assert isinstance(action, Fail) and type(action.error) is RoutingError and action.error.status == 503
    assert abs(sum(sleeps) - 60.0) < 1e-6 and max(sleeps) <= 0.025


def test_p143_max_wait_shorter_than_affinity_wait_ends_with_503() -> None:
    view, _ = scripted([Wait(200.0)])
    _, action, sleeps = route(make_machine(), fresh(max_wait_ms=50), view)
    assert isinstance(action, Fail) and action.error.status == 503
    assert abs(sum(sleeps) - 0.050) < 1e-9


def test_the_policy_sees_the_deadline_its_waits_end_at() -> None:
    view, policy = scripted([Wait(10.0), SELECT0])
    route(make_machine(), fresh(max_wait_ms=50), view)
    received = policy.seen[0].received_at
    assert [r.wait_deadline for r in policy.seen] == [received + 0.050] * 2
    view, policy = scripted([SELECT0])
    route(make_machine(), fresh(), view)
    assert policy.seen[0].wait_deadline == policy.seen[0].received_at + 60.0


def test_p122_unavailable_without_max_wait_fails_immediately() -> None:
    view, policy = scripted([UNAVAILABLE])
    _, action, sleeps = route(make_machine(), fresh(), view)
    assert isinstance(action, Fail) and action.error.status == 503
    assert sleeps == [] and len(policy.seen) == 1


def test_p122_unavailable_polls_1_to_9ms_until_capped_deadline() -> None:
    view, _ = scripted([UNAVAILABLE])
    state, action, sleeps = route(make_machine(), fresh(max_wait_ms=60_000), view)
    assert isinstance(action, Fail) and action.error.status == 503
    assert abs(sum(sleeps) - 60.0) < 1e-6
    assert all(s <= 0.009 + 1e-12 for s in sleeps)
    assert all(s >= 0.001 - 1e-12 for s in sleeps[:-1])
    assert state.routing_retry_attempts == len(sleeps)


def test_held_requests_share_one_rate_of_routes_again() -> None:
    """4 000 held requests each routed again every few ms took the event loop whole."""
    machine, rng = make_machine(), random.Random(7)
    for decision, alone in ((UNAVAILABLE, (0.001, 0.009)), (Wait(3.0), (0.003, 0.003))):
        view, _ = scripted([decision])
        state = fresh(max_wait_ms=60_000)
        for held, (low, high) in ((0, alone), (128, alone), (4128, (1.0, 3.0))):
            for _ in range(50):
                _, action = machine.step(state, Woke(held=held), view, 100.0, rng)
                assert isinstance(action, Sleep) and low - 1e-9 <= action.seconds <= high + 1e-9
    view, _ = scripted([UNAVAILABLE])
    _, action = machine.step(fresh(max_wait_ms=500), Woke(held=4128), view, 100.4, rng)
    assert isinstance(action, Sleep) and action.seconds == pytest.approx(0.1)  # never past the wait


def test_a_request_no_backend_could_take_says_whether_it_waited() -> None:
    view, _ = scripted([UNAVAILABLE])
    _, now, _ = route(make_machine(), fresh(), view)
    assert isinstance(now, Fail) and now.error.code == "no_selectable_backend"
    assert "x-max-wait-ms lets it wait" in str(now.error)
    _, waited, _ = route(make_machine(), fresh(max_wait_ms=250), view)
    assert isinstance(waited, Fail) and waited.error.code == "no_selectable_backend"
    assert "within its 250 ms wait" in str(waited.error)


def test_unavailable_then_selected_within_max_wait() -> None:
    view, _ = scripted([UNAVAILABLE, UNAVAILABLE, SELECT0])
    _, action, sleeps = route(make_machine(), fresh(max_wait_ms=250), view)
    assert isinstance(action, Send) and len(sleeps) == 2


def test_p148_every_candidate_excluded_finalizes_without_waiting() -> None:
    view, policy = scripted([Wait(200.0)], clusters=("c1", "c2"))
    state = AttemptState(make_request(max_wait_ms=1000), failed_cluster_ids=frozenset({"c1", "c2"}))
    state, action, sleeps = route(make_machine(), state, view)
    assert isinstance(action, Fail) and type(action.error) is RoutingError
    assert state.notes == (Exhausted("no_eligible_backend"),)
    assert sleeps == [] and policy.seen == []


def test_exclusions_are_passed_to_the_policy() -> None:
    view, policy = scripted([Selected(Choice(1))], clusters=("c1", "c2"))
    state = AttemptState(make_request(), failed_cluster_ids=frozenset({"c1"}))
    _, action, _ = route(make_machine(), state, view)
    assert isinstance(action, Send) and action.backend.cluster_id == "c2"
    assert policy.seen[0].excluded == frozenset({"c1"})


def test_p101_unknown_target_is_404_no_eligible_candidates() -> None:
    _, action, sleeps = route(make_machine(), fresh(max_wait_ms=1000), NoTarget(advertised=False))
    assert isinstance(action, Fail) and isinstance(action.error, NoEligibleCandidates)
    assert action.error.status == 404 and action.error.code == "no_eligible_candidates"
    assert sleeps == []


def test_p120_advertised_but_inactive_target_is_plain_503() -> None:
    state, action, _ = route(make_machine(), fresh(), NoTarget(advertised=True))
    assert isinstance(action, Fail) and type(action.error) is RoutingError and state.notes == ()


def test_target_gone_after_failures_is_503_not_404() -> None:
    state = AttemptState(make_request(), failed_backend_ids=frozenset({"x"}))
    state, action, _ = route(make_machine(), state, NoTarget(advertised=False))
    assert isinstance(action, Fail) and type(action.error) is RoutingError
    assert state.notes == (Exhausted("no_eligible_backend"),)


def test_cluster_without_eligible_backend_is_excluded_and_rerouted_p90() -> None:
    view, policy = scripted([SELECT0, Selected(Choice(1))], clusters=("c1", "c2"))
    state = AttemptState(make_request(), failed_backend_ids=frozenset({"c1-b"}))
    state, action, _ = route(make_machine(), state, view)
    assert isinstance(action, Send) and action.backend.inference_server_id == "c2-b"
    assert state.failed_cluster_ids == {"c1"}
    assert policy.seen[1].excluded == frozenset({"c1"})
    assert action.choice == Choice(1)  # one selection, for the cluster that had a backend


def test_p118_admission_rejection_is_503_with_code_and_noted() -> None:
    definition = AlgorithmDefinition(Algorithm.POWER_OF_N, max_input_work_seconds=0.5)
    view, policy = scripted([SELECT0])
    state, action, _ = route(make_machine("input_work_limit_exceeded"), fresh(definition=definition), view)
    assert isinstance(action, Fail) and isinstance(action.error, InputWorkLimitExceeded)
    assert (action.error.status, action.error.code) == (503, "input_work_limit_exceeded")
    assert state.notes == (AdmissionRejected("input_work_limit_exceeded"),)
    assert policy.seen == []


def test_p118_admission_configured_unknown_model_still_404() -> None:
    definition = AlgorithmDefinition(Algorithm.POWER_OF_N, max_input_work_seconds=0.5)
    machine = make_machine("input_work_capacity_unavailable")
    _, action, _ = route(machine, fresh(definition=definition), NoTarget(advertised=False))
    assert isinstance(action, Fail) and isinstance(action.error, NoEligibleCandidates)


def test_admission_not_consulted_without_limit() -> None:
    view, _ = scripted([SELECT0])
    assert isinstance(route(make_machine("input_work_limit_exceeded"), fresh(), view)[1], Send)


def test_p27_expected_queue_uses_free_slot_rule() -> None:
    busy = make_candidate(
        "c1",
        max_concurrency=8,
        running=3,
        queued=10_000,
        tps=100.0,
    )
    _, action, _ = route(make_machine(), fresh(), with_candidates((busy,)))
    assert isinstance(action, Send) and action.expected_queue_ms == 0


def test_p28_p104_expected_queue_from_backlog_when_full_and_none_when_unknown() -> None:
    full = make_candidate(
        "c1",
        max_concurrency=8,
        running=8,
        queued=4200,
        tps=100_000.0,
    )
    _, action, _ = route(make_machine(), fresh(), with_candidates((full,)))
    assert isinstance(action, Send) and action.expected_queue_ms == 42
    unknown = make_candidate("c1", queued=5, tps=0.0)
    _, action, _ = route(make_machine(), fresh(), with_candidates((unknown,)))
    assert isinstance(action, Send) and action.expected_queue_ms is None


def test_load_aware_expected_queue_counts_this_routers_requests_in_flight() -> None:
    # Published: 3 of 8 running. This router has 8 in flight there (a burst the next heartbeat
    # has not counted yet), 4200 prompt tokens of them before their first byte.
    busy = dataclasses.replace(
        make_candidate("c1", max_concurrency=8, running=3, tps=100_000.0), in_flight=InFlight(8, 4, 4200)
    )
    load_aware = AlgorithmDefinition(Algorithm.POWER_OF_N, load_aware=True)
    _, action, _ = route(make_machine(), fresh(definition=load_aware), with_candidates((busy,)))
    assert isinstance(action, Send) and action.expected_queue_ms == 42
    # The spec's configurations keep the published free-slot rule.
    _, action, _ = route(make_machine(), fresh(), with_candidates((busy,)))
    assert isinstance(action, Send) and action.expected_queue_ms == 0


def test_request_fields_reach_the_policy() -> None:
    view, policy = scripted([SELECT0])
    request: ProxyRequest = make_request(
        priority=4, cache_affinity_key="k", request_slo_ms=900, input_tokens=33
    )
    route(make_machine(), start(request), view)
    seen: LbRequest = policy.seen[0]
    assert (seen.priority, seen.cache_affinity_key, seen.request_slo_ms, seen.input_tokens) == (
        4,
        "k",
        900,
        33,
    )
    assert seen.received_at == request.received_at


def test_a_step_returns_a_new_state_and_never_changes_the_old_one() -> None:
    view, _ = scripted([SELECT0])
    request = make_request()
    before = start(request)
    after, action = make_machine().step(before, Start(), view, 100.0, random.Random(1))
    assert isinstance(action, Pick) and before == start(request) and after.cluster_id == "c1"


def test_notes_last_one_step_only() -> None:
    state = AttemptState(make_request(), failed_backend_ids=frozenset({"x"}), notes=(Exhausted("old"),))
    state, action = make_machine().step(state, Start(), NoTarget(advertised=True), 100.0, random.Random(1))
    assert state.notes == (Exhausted("no_eligible_backend"),) and isinstance(action, Fail)


def test_a_router_that_just_started_lets_a_request_wait_for_its_model_to_register() -> None:
    starting = NoTarget(advertised=False, starting=True)
    _, action, sleeps = route(make_machine(), fresh(max_wait_ms=100), starting)
    assert isinstance(action, Fail) and isinstance(action.error, NoEligibleCandidates)
    assert abs(sum(sleeps) - 0.100) < 1e-9 and max(sleeps) <= 0.025
    _, action, sleeps = route(make_machine(), fresh(), starting)  # no routing wait: the spec's 404
    assert isinstance(action, Fail) and isinstance(action.error, NoEligibleCandidates) and sleeps == []
    view, _ = scripted([SELECT0])
    state, action = make_machine().step(fresh(max_wait_ms=100), Start(), starting, 100.0, random.Random(1))
    state, action = make_machine().step(state, Woke(), view, 100.025, random.Random(1))
    assert isinstance(action, Pick)  # it registered meanwhile


def test_a_request_that_would_wait_while_the_router_holds_its_limit_gets_503_at_once() -> None:
    machine = AttemptMachine(
        RetrySettings(max_held_requests=3), admission=lambda d, c, r: None, expected_queue=expected_queue_ms
    )
    rng = random.Random(1)
    for decision in (UNAVAILABLE, Wait(50.0)):
        view, _ = scripted([decision])
        _, action = machine.step(fresh(max_wait_ms=1000), Start(held=3), view, 100.0, rng)
        assert isinstance(action, Fail) and type(action.error) is RoutingError
        assert str(action.error) == "the router already holds 3 waiting requests (--max-held-requests)"
        _, action = machine.step(fresh(max_wait_ms=1000), Start(held=2), view, 100.0, rng)
        assert isinstance(action, Sleep)  # room for one more
    view, _ = scripted([SELECT0])
    _, action = machine.step(fresh(max_wait_ms=1000), Start(held=3), view, 100.0, rng)
    assert isinstance(action, Pick)  # one that need not wait is not held
    view, _ = scripted([UNAVAILABLE])
    _, action = machine.step(fresh(max_wait_ms=1000), Woke(), view, 100.0, rng)
    assert isinstance(action, Sleep)  # one already waiting keeps its place
    unlimited = AttemptMachine(
        RetrySettings(max_held_requests=0), admission=lambda d, c, r: None, expected_queue=expected_queue_ms
    )
    _, action = unlimited.step(fresh(max_wait_ms=1000), Start(held=10**6), view, 100.0, rng)
    assert isinstance(action, Sleep)


def test_a_request_that_would_wait_once_the_router_is_closing_gets_503() -> None:
    """The drain ran out: held requests end at their next pass, new ones do not start to wait, and
    one that finds room now is still sent."""
    machine = AttemptMachine(
        RetrySettings(), admission=lambda d, c, r: None, expected_queue=expected_queue_ms
    )
    rng = random.Random(1)
    for event in (Woke(closing=True), Start(closing=True)):
        for decision in (UNAVAILABLE, Wait(50.0)):
            view, _ = scripted([decision])
            _, action = machine.step(fresh(max_wait_ms=1000), event, view, 100.0, rng)
            assert isinstance(action, Fail) and type(action.error) is RoutingError
            assert str(action.error) == "the router is shutting down"
        view, _ = scripted([SELECT0])
        _, action = machine.step(fresh(max_wait_ms=1000), event, view, 100.0, rng)
        assert isinstance(action, Pick)
