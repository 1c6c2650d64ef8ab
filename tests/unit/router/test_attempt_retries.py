"""The attempt machine's retry rules (spec §4.8), one event at a time: no driver, no sockets."""

from __future__ import annotations

import random
from dataclasses import replace

from support.router_fakes import ScriptedPolicy, backend, make_request, make_view

from stargate.balancer.types import UNAVAILABLE, Choice, Selected
from stargate.errors import (
    PayloadTooLarge,
    UpstreamBroken,
    UpstreamError,
    UpstreamInvalid,
    UpstreamNotSent,
    UpstreamTimeout,
)
from stargate.router.attempt import (
    Action,
    Answered,
    AttemptMachine,
    AttemptState,
    Event,
    Evicted,
    Exhausted,
    Fail,
    Pick,
    Picked,
    Reconnect,
    Reconnected,
    Relay,
    Retried,
    RetrySettings,
    Send,
    SendFailed,
)
from stargate.router.replay import Readiness
from stargate.router.retry_signal import RetrySignal

A = backend("a", "c1")
VIEW = make_view({"c1": ["a", "b"], "c2": ["z"]})
READY = Readiness.READY


def sending(**kw: object) -> AttemptState:
    """A request whose attempt on backend ``a`` (cluster c1) is out."""
    return AttemptState(make_request(received_at=10.0, **kw), backend=A, cluster_id="c1")


def step(
    state: AttemptState, event: Event, now: float = 10.0, **settings: int
) -> tuple[AttemptState, Action]:
    machine = AttemptMachine(
        RetrySettings(**settings), admission=lambda d, c, r: None, expected_queue=lambda c, p, la: None
    )
    return machine.step(state, event, VIEW, now, random.Random(1))


def signal(reason: str, retryable: bool = True) -> RetrySignal:
    return RetrySignal(retryable, reason, False)


def test_a_refused_connection_reconnects_the_same_backend() -> None:
    state, action = step(sending(), SendFailed(UpstreamNotSent("refused"), READY))
    assert action == Reconnect(A) and state.connect_retries == 1
    assert state.notes == (Evicted("a"),)
    state, action = step(state, Reconnected(True))
    assert action == Send(A, None, None) and state.notes == (Retried("hot_path_reconnect"),)


def test_a_failed_reconnect_picks_a_sibling() -> None:
    state, _ = step(sending(), SendFailed(UpstreamError("reset"), READY))
    state, action = step(state, Reconnected(False))
    assert action == Pick("c1", frozenset({"a"})) and state.notes == (Retried("connect_failover"),)


def test_a_header_timeout_never_goes_back_to_the_same_backend() -> None:
    state, action = step(sending(), SendFailed(UpstreamTimeout("no headers"), READY))
    assert action == Pick("c1", frozenset({"a"}))
    assert state.failed_backend_ids == {"a"} and state.connect_retries == 1
    assert state.notes == (Retried("connect_failover"),)


def test_a_body_broken_before_its_first_byte_never_goes_back_to_the_same_backend() -> None:
    state, action = step(sending(), SendFailed(UpstreamBroken("reset before the body"), READY))
    assert action == Pick("c1", frozenset({"a"}))
    assert state.failed_backend_ids == {"a"} and state.connect_retries == 1
    assert state.notes == (Retried("connect_failover"),)


def test_an_answer_that_cannot_be_read_ends_the_request_where_it_ran() -> None:
    error = UpstreamInvalid("unreadable head")
    state, action = step(sending(), SendFailed(error, READY))
    assert action == Fail(error, "a") and state.connect_retries == 0 and state.notes == ()


def test_transport_failures_end_when_budget_or_retries_are_spent() -> None:
    error = UpstreamNotSent("refused")
    state, action = step(sending(retry_budget_ms=0), SendFailed(error, READY))
    assert action == Fail(error, "a") and state.notes == (Exhausted("retry_budget_exhausted"),)
    state, action = step(sending(), SendFailed(error, READY), max_connect_retries=0)
    assert action == Fail(error, "a") and state.notes == (Exhausted("connect_retries_exhausted"),)


def test_a_transport_failure_with_no_other_backend_left_ends_with_that_failure() -> None:
    """Not the 503 of a request nobody could take: the client learns what happened; a retryable
    refusal after it is what the request ends with then (spec behaviour 112)."""
    alone = make_view({"c1": ["a"]})
    machine = AttemptMachine(
        RetrySettings(), admission=lambda d, c, r: None, expected_queue=lambda c, p, la: None
    )
    error = UpstreamBroken("reset before the body")
    state, action = machine.step(sending(), SendFailed(error, READY), alone, 10.0, random.Random(1))
    state, action = machine.step(state, Picked(None), alone, 10.0, random.Random(1))
    assert action == Fail(error, "a") and state.notes == (Exhausted("no_eligible_backend"),)
    two = make_view({"c1": ["a"], "c2": ["z"]})
    state, action = machine.step(sending(), SendFailed(error, READY), two, 10.0, random.Random(1))
    state, action = machine.step(state, Picked(None), two, 10.0, random.Random(1))
    assert isinstance(action, Pick) and action.cluster_id == "c2"
    state = replace(state, backend=backend("z", "c2"), cluster_id="c2")
    state, action = machine.step(state, Answered(503, signal("busy"), READY), two, 10.0, random.Random(1))
    assert isinstance(action, Fail) and action.error.code == "no_selectable_backend"


def test_a_body_that_cannot_be_replayed_ends_the_request() -> None:
    error = UpstreamError("reset mid-body")
    _, action = step(sending(), SendFailed(error, Readiness.INCOMPLETE))
    assert action == Fail(error, "a")
    _, action = step(sending(), SendFailed(error, Readiness.PAYLOAD_TOO_LARGE))
    assert isinstance(action, Fail) and isinstance(action.error, PayloadTooLarge) and action.backend_id == "a"


def test_answers_that_are_not_retryable_or_out_of_retries_are_relayed() -> None:
    assert step(sending(), Answered(200, signal("x", retryable=False), READY))[1] == Relay()
    state, action = step(sending(), Answered(429, signal("busy"), READY), max_request_retries=0)
    assert action == Relay() and state.notes == (Exhausted("busy"),)
    state, action = step(sending(retry_budget_ms=0), Answered(429, signal("busy"), READY))
    assert action == Relay() and state.notes == (Exhausted("retry_budget_exhausted"),)
    assert step(sending(), Answered(429, signal("busy"), Readiness.INCOMPLETE))[1] == Relay()


def test_queue_mismatch_tries_a_sibling_and_other_reasons_exclude_the_cluster() -> None:
    state, action = step(sending(), Answered(429, signal("queue_estimate_mismatch"), READY))
    assert action == Pick("c1", frozenset({"a"})) and state.request_retries == 1
    assert state.notes == (Retried("queue_estimate_mismatch"),)
    state, action = step(sending(), Answered(503, signal("local_connect_failure"), READY))
    assert isinstance(action, Pick) and action.cluster_id == "c2"
    assert state.failed_cluster_ids == {"c1"} and state.notes == (Retried("local_connect_failure"),)
    assert state.choice is not None  # a fresh balancer selection, counted when sent


def test_a_retry_whose_body_overflowed_is_413_for_that_backend() -> None:
    _, action = step(sending(), Answered(429, signal("busy"), Readiness.PAYLOAD_TOO_LARGE))
    assert isinstance(action, Fail) and action.error.status == 413 and action.backend_id == "a"


def _refused_everywhere(**kw: object) -> AttemptState:
    """Out of request retries: a and z (every cluster) refused it as busier than expected."""
    return replace(
        sending(**kw),
        request_retries=2,
        failed_backend_ids=frozenset({"a", "b", "z"}),
        failed_cluster_ids=frozenset({"c2"}),
        mismatched=frozenset({("b", "c1"), ("z", "c2")}),
    )


def test_a_request_refused_everywhere_is_routed_again_within_its_routing_wait() -> None:
    mismatch = Answered(429, signal("queue_estimate_mismatch"), READY)
    state, action = step(_refused_everywhere(max_wait_ms=5000), mismatch)
    # The refusing backends are back in; the next attempt goes without an expected queue.
    assert action == Pick("c1", frozenset())
    assert not state.expects_queue and state.notes == (Retried("queue_estimate_mismatch"),)
    assert (state.failed_backend_ids, state.failed_cluster_ids) == (frozenset(), frozenset())
    state, action = step(state, Picked(A))
    assert isinstance(action, Send) and (action.backend, action.expected_queue_ms) == (A, None)
    # Once only: refused again (another reason) it ends as the original does.
    state, action = step(state, Answered(429, signal("busy"), READY))
    assert action == Relay() and state.notes == (Exhausted("busy"),)


def test_a_request_without_a_routing_wait_refused_everywhere_is_routed_again_once() -> None:
    # An engine with no slot limit (or every backend busier than the router's view): failing the
    # request would leave capacity unused, so it queues at Pylon like a request with a wait.
    mismatch = Answered(429, signal("queue_estimate_mismatch"), READY)
    state, action = step(_refused_everywhere(), mismatch)
    assert action == Pick("c1", frozenset()) and not state.expects_queue
    state, action = step(state, Picked(A))
    state, action = step(state, mismatch)
    assert action == Relay() and state.notes[-1] == Exhausted("queue_estimate_mismatch")


def test_past_its_routing_wait_a_refused_request_ends_as_in_the_original() -> None:
    mismatch = Answered(429, signal("queue_estimate_mismatch"), READY)
    state, action = step(_refused_everywhere(max_wait_ms=5000), mismatch, now=15.0)
    assert action == Relay() and state.notes == (Exhausted("queue_estimate_mismatch"),)
    # Other reasons are never requeued.
    state, action = step(_refused_everywhere(max_wait_ms=5000), Answered(503, signal("busy"), READY))
    assert action == Relay()


def test_a_request_whose_last_cluster_refused_it_is_routed_again_within_its_routing_wait() -> None:
    # Retries left, but the mismatch removed the last cluster: requeued instead of 503.
    state = replace(
        sending(max_wait_ms=5000),
        failed_cluster_ids=frozenset({"c2"}),
        failed_backend_ids=frozenset({"b", "z"}),
        mismatched=frozenset({("z", "c2"), ("b", "c1")}),
    )
    state, action = step(state, Answered(429, signal("queue_estimate_mismatch"), READY))
    assert action == Pick("c1", frozenset({"a", "b", "z"}))
    state, action = step(state, Picked(None))
    assert isinstance(action, Pick) and not state.expects_queue
    assert state.failed_backend_ids == frozenset()


def test_a_request_refused_where_the_rest_is_full_is_queued_where_it_was_refused() -> None:
    """a refused it as busier than expected (a canary held the slot), z is full: without a routing
    wait it ended 503; it is sent to a again, without an expected queue, which Pylon admits."""
    policy = ScriptedPolicy([UNAVAILABLE, Selected(Choice(0)), UNAVAILABLE])
    view = make_view({"c1": ["a"], "c2": ["z"]}, policy)
    machine = AttemptMachine(
        RetrySettings(), admission=lambda d, c, r: None, expected_queue=lambda c, p, la: 0
    )
    mismatch = Answered(429, signal("queue_estimate_mismatch"), READY)
    state, action = machine.step(sending(), mismatch, view, 10.0, random.Random(1))
    assert action == Pick("c1", frozenset({"a"}))
    state, action = machine.step(state, Picked(None), view, 10.0, random.Random(1))
    assert action == Pick("c1", frozenset()) and not state.expects_queue
    state, action = machine.step(state, Picked(A), view, 10.0, random.Random(1))
    assert isinstance(action, Send) and action.expected_queue_ms is None
    # Once: refused again, and the rest still full, it ends as in the original.
    state, action = machine.step(state, mismatch, view, 10.0, random.Random(1))
    state, action = machine.step(state, Picked(None), view, 10.0, random.Random(1))
    assert isinstance(action, Fail) and action.error.status == 503


def test_a_requeue_does_not_bring_back_a_backend_that_refused_for_another_reason() -> None:
    """a's engine died (local_connect_failure), its sibling b was busier than expected: the
    requeue brings c1 back for b, and sent a to its dead engine again."""
    state, action = step(sending(max_wait_ms=5000), Answered(503, signal("local_connect_failure"), READY))
    assert action == Pick("c2", frozenset({"a"}))
    assert state.failed_backend_ids == {"a"} and state.failed_cluster_ids == {"c1"}
    state = replace(
        state,
        request_retries=2,
        backend=backend("b", "c1"),
        failed_backend_ids=state.failed_backend_ids | {"z"},
        failed_cluster_ids=state.failed_cluster_ids | {"c2"},
        mismatched=frozenset({("z", "c2")}),
    )
    state, action = step(state, Answered(429, signal("queue_estimate_mismatch"), READY))
    assert isinstance(action, Pick) and "a" in action.failed_backend_ids


def test_a_request_every_backend_refused_tells_its_client_the_soonest_retry_after() -> None:
    state, action = step(sending(), Answered(503, RetrySignal(True, "busy", False, 3000), READY))
    assert action == Pick("c2", frozenset({"a"}))
    state, action = step(state, Picked(backend("z", "c2")))
    state, action = step(state, Answered(503, RetrySignal(True, "busy", False, 1500), READY))
    assert isinstance(action, Fail) and action.error.status == 503
    assert action.error.retry_headers() == {"Retry-After": "2", "retry-after-ms": "1500"}
    # Refusals that named no time leave the answer as it was.
    state, action = step(sending(), Answered(503, signal("busy"), READY))
    state, action = step(state, Picked(backend("z", "c2")))
    state, action = step(state, Answered(503, signal("busy"), READY))
    assert isinstance(action, Fail) and action.error.retry_headers() == {}
