"""The attempt machine: the routing loop (spec §4.7) and the retry rules (§4.8) as one pure step function.

``AttemptMachine.step(state, event, snapshot, now, rng)`` returns the next ``AttemptState`` and one
``Action`` for the driver to perform; the driver answers with the ``Event`` that action produced
(in the manner of httpx's sans-I/O auth flow). The machine never sleeps, sends or reads a clock:
tests run every rule without sockets, and the driver (``router/driver.py``) is the only place that
does I/O and records metrics (from the actions and from ``state.notes``).

Routing pass (on ``Start``, ``Woke`` and a cluster that ran out of backends):

* every candidate excluded (or none) → final ``Fail``: 404 ``NoEligibleCandidates`` for a target
  nobody advertises when nothing failed in this request, the last attempt's transport failure
  (502) when no backend answered since (not in the original, whose 503 told the client nobody
  could take it), else 503 ``RoutingError``. Not in the original: a request with a routing wait
  that finds no target while the router is ``starting`` polls every 25 ms within that wait, as a
  restarted router's Pylons register again;
* a request that arrives while the router holds ``max_held_requests`` and would wait → 503
  ``RoutingError`` at once (not in the original, whose waits are bounded only by time); so does a
  request that would wait (again) once the router is closing (its drain ran out: it is about to
  stop, and a 503 can be retried elsewhere where a cut connection cannot);
* input-work admission rejection → ``Fail(InputWorkLimitExceeded)``;
* ``Selected`` → ``Pick`` a backend of the chosen cluster; ``Picked(None)`` excludes the cluster and
  routes again (the one place "pick a backend, else exclude the cluster" is written);
* ``Wait(d)`` → ``Sleep(min(d, 25 ms, wait_deadline - now))``; ``Unavailable`` or no time left →
  ``Sleep`` 1-9 ms only while an explicit ``x-max-wait-ms`` deadline remains, else fail.

Attempt outcomes:

* ``Answered`` (response headers arrived): not retryable, budget spent, retries used up or the body
  not replayable → ``Relay``; ``queue_estimate_mismatch`` → a sibling in the same cluster; any other
  retryable reason → the cluster is excluded and routing runs again. Not in the original: a request
  that ``queue_estimate_mismatch`` refusals would end (retries used up, or every cluster excluded)
  and that is not past a routing wait is requeued once instead (``_requeues``): routed again with the
  refusing backends back in and sent without an expected queue, which Pylon admits; so is one that
  such a refusal left with no backend to take it now.
* ``SendFailed`` (no response): ``UpstreamNotSent`` / a broken connection → ``Reconnect`` the same
  backend, then the same backend again or (``Reconnected(False)``) a sibling; ``UpstreamTimeout``
  → never the same backend again (it may still be running the request): a sibling at once.
  ``UpstreamBroken`` (not in the original: the driver relays a response only once its first body
  byte is in hand, so a body that breaks before it has told the client nothing) is handled like a
  timeout: the backend may have run part of the request. ``UpstreamInvalid`` (a response head
  that cannot be read: the backend ran the request) → ``Fail``, never sent again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Protocol

from stargate.balancer.settings import AlgorithmDefinition, Policy
from stargate.balancer.types import Candidate, Choice, LbRequest, Selected, Wait
from stargate.errors import (
    InputWorkLimitExceeded,
    NoEligibleCandidates,
    PayloadTooLarge,
    RoutingError,
    StargateError,
    UpstreamBroken,
    UpstreamError,
    UpstreamInvalid,
    UpstreamTimeout,
)
from stargate.router.headers import MAX_WAIT_CAP_MS, ProxyRequest
from stargate.router.replay import Readiness
from stargate.router.retry_signal import QUEUE_ESTIMATE_MISMATCH, RetrySignal
from stargate.router.transport import BackendRef

WAIT_POLL_CAP_S = 0.025
UNAVAILABLE_POLL_MS = (1, 9)
HELD_UNPACED = 128
HELD_ROUTES_PER_S = 2000.0
"""Past ``HELD_UNPACED`` held requests, each one's pause before it is routed again grows with their
number, so that they are routed about this often all together. At a few milliseconds each, 4 000
held requests took the event loop whole and freed slots were filled late; at this rate a freed
slot still waits half a millisecond, on average, for a held request to find it. Fewer keep their
own pace: a request waiting for its key's replica notices room there within milliseconds."""


class TargetSnapshot(Protocol):
    """An immutable view of one routing target with reservations applied."""

    @property
    def candidates(self) -> tuple[Candidate, ...]: ...
    def policy(self, definition: AlgorithmDefinition) -> Policy: ...
    def pick_backend(self, cluster_id: str, failed_backend_ids: AbstractSet[str]) -> BackendRef | None: ...


@dataclass(frozen=True, slots=True)
class NoTarget:
    """The target has no routable cluster; ``advertised`` tells 503 from 404. ``starting``: the
    router started moments ago, and backends may still be registering (``RoutingState.starting``)."""

    advertised: bool
    starting: bool = False
    candidates: tuple[Candidate, ...] = ()


Snapshot = TargetSnapshot | NoTarget

AdmissionCheck = Callable[[AlgorithmDefinition, tuple[Candidate, ...], LbRequest], str | None]
"""``stargate.balancer.check_admission``: the rejection reason (a ``StrEnum``) or None to admit."""
ExpectedQueue = Callable[[Candidate, int, bool], int | None]
"""``stargate.balancer.expected_queue_ms``: the header value for a candidate, priority and ``load_aware``."""


@dataclass(frozen=True, slots=True)
class RetrySettings:
    max_connect_retries: int = 2
    max_request_retries: int = 2
    require_pylon_retry_signal: bool = True
    max_held_requests: int = 10_000
    """Requests the router may hold waiting for room at once (0 = no limit; not in the original)."""


# ---- notes: what a step decided that the driver counts ------------------------------------------


@dataclass(frozen=True, slots=True)
class Retried:
    reason: str


@dataclass(frozen=True, slots=True)
class Exhausted:
    reason: str


@dataclass(frozen=True, slots=True)
class Evicted:
    backend_id: str


@dataclass(frozen=True, slots=True)
class AdmissionRejected:
    reason: str


Note = Retried | Exhausted | Evicted | AdmissionRejected


CLOSING = "the router is shutting down"
"""Why a request that would wait fails once the router's drain ran out."""


# ---- events: what happened --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    held: int = 0
    """Requests the router holds waiting for room as this one arrives."""
    closing: bool = False
    """The router is about to stop: the request may not wait."""


@dataclass(frozen=True, slots=True)
class Woke:
    closing: bool = False
    held: int = 0
    """The other requests the router holds waiting for room as this one wakes."""


@dataclass(frozen=True, slots=True)
class Picked:
    backend: BackendRef | None


@dataclass(frozen=True, slots=True)
class Answered:
    """Response headers arrived; ``readiness`` is the replay buffer's state at that moment."""

    status: int
    signal: RetrySignal
    readiness: Readiness


@dataclass(frozen=True, slots=True)
class SendFailed:
    error: UpstreamError
    readiness: Readiness


@dataclass(frozen=True, slots=True)
class Reconnected:
    ok: bool


Event = Start | Woke | Picked | Answered | SendFailed | Reconnected


# ---- actions: what to do next -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pick:
    cluster_id: str
    failed_backend_ids: frozenset[str]


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Send:
    """One attempt; ``choice`` is set when the backend came from a fresh balancer selection."""

    backend: BackendRef
    expected_queue_ms: int | None
    choice: Choice | None


@dataclass(frozen=True, slots=True)
class Reconnect:
    backend: BackendRef


@dataclass(frozen=True, slots=True)
class Relay:
    """Stream the last upstream response to the client: final once its first body byte (or its
    clean end) arrived; a body broken before that comes back as ``SendFailed(UpstreamBroken)``."""


@dataclass(frozen=True, slots=True)
class Fail:
    """Final: Stargate answers ``error`` itself; ``backend_id`` is "" when no attempt was made."""

    error: StargateError
    backend_id: str


Action = Pick | Sleep | Send | Reconnect | Relay | Fail


@dataclass(frozen=True, slots=True)
class AttemptState:
    """Everything one request has learned so far; a step returns a new value, never changes one."""

    request: ProxyRequest
    failed_backend_ids: frozenset[str] = frozenset()
    failed_cluster_ids: frozenset[str] = frozenset()
    connect_retries: int = 0
    request_retries: int = 0
    routing_retry_attempts: int = 0
    backend: BackendRef | None = None
    cluster_id: str = ""
    expected_queue_ms: int | None = None
    choice: Choice | None = None
    mismatched: frozenset[tuple[str, str]] = frozenset()
    """(backend id, cluster id) of each backend that answered ``queue_estimate_mismatch``."""
    expects_queue: bool = True
    """False once the request was requeued past its mismatches: it is sent without an estimate."""
    retry_after_ms: int | None = None
    """The soonest a backend that refused the request said to try again; the client is told it
    when every backend refused."""
    reconnected: bool = False
    """The attempt in flight is the backend's second, on a fresh connection (hot-path reconnect)."""
    broken: Fail | None = None
    """The last attempt's transport failure, while no backend answered since: the request ends
    with it when no other backend is left, not with the 503 of a request nobody could take."""
    notes: tuple[Note, ...] = field(default=(), compare=False)

    @property
    def any_failure(self) -> bool:
        return bool(self.failed_backend_ids or self.failed_cluster_ids)


def start(request: ProxyRequest) -> AttemptState:
    return AttemptState(request)


@dataclass(frozen=True, slots=True)
class AttemptMachine:
    """The rules of one router process; ``step`` is the whole routing and retry policy."""

    settings: RetrySettings
    admission: AdmissionCheck
    expected_queue: ExpectedQueue

    def step(
        self, state: AttemptState, event: Event, snapshot: Snapshot, now: float, rng: random.Random
    ) -> tuple[AttemptState, Action]:
        if state.notes:
            state = replace(state, notes=())
        if isinstance(event, Start):
            limit = self.settings.max_held_requests
            refusal = CLOSING if event.closing else None
            if 0 < limit <= event.held:
                refusal = f"the router already holds {limit} waiting requests (--max-held-requests)"
            return self._route(state, snapshot, now, rng, refusal, event.held)
        if isinstance(event, Woke):
            return self._route(state, snapshot, now, rng, CLOSING if event.closing else None, event.held)
        if isinstance(event, Picked):
            return self._picked(state, event.backend, snapshot, now, rng)
        if isinstance(event, Answered):
            return self._answered(state, event, snapshot, now, rng)
        if isinstance(event, SendFailed):
            return self._send_failed(state, event, now)
        return self._reconnected(state, event.ok)

    # ---- routing (§4.7) ------------------------------------------------------------------------

    def _route(
        self,
        state: AttemptState,
        snapshot: Snapshot,
        now: float,
        rng: random.Random,
        refusal: str | None = None,
        held: int = 0,
    ) -> tuple[AttemptState, Action]:
        """``refusal``: why this request may not wait (the router holds ``max_held_requests``
        already, or is closing); it then fails with that reason where it would wait. ``held``:
        the requests the router holds, past ``HELD_UNPACED`` routed again at ``HELD_ROUTES_PER_S``."""
        request = state.request
        candidates = snapshot.candidates
        excluded = state.failed_cluster_ids
        if isinstance(snapshot, NoTarget) or all(c.cluster_id in excluded for c in candidates):
            if _requeues(state, now):
                return self._route(_requeued(state), snapshot, now, rng, refusal, held)
            if isinstance(snapshot, NoTarget) and snapshot.starting:  # backends may be registering
                routing_deadline = _routing_deadline(request)
                if routing_deadline is not None and now < routing_deadline:
                    return self._wait(state, min(WAIT_POLL_CAP_S, routing_deadline - now), refusal)
            return self._unroutable(state, snapshot)
        max_wait_ms = MAX_WAIT_CAP_MS if request.max_wait_ms is None else request.max_wait_ms
        wait_deadline = request.received_at + max_wait_ms / 1000.0
        lb_request = LbRequest(
            target=request.target,
            input_tokens=request.input_tokens,
            received_at=request.received_at,
            now=now,
            priority=request.priority,
            cache_affinity_key=request.cache_affinity_key,
            request_slo_ms=request.request_slo_ms,
            excluded=excluded,
            wait_deadline=wait_deadline,
        )
        definition = request.definition
        if definition.max_input_work_seconds is not None:
            rejection = self.admission(definition, candidates, lb_request)
            if rejection is not None:
                reason = str(rejection)
                state = _noted(state, AdmissionRejected(reason))
                return state, Fail(InputWorkLimitExceeded(reason), "")
        decision = snapshot.policy(definition).decide(candidates, lb_request, rng)
        if isinstance(decision, Selected):
            candidate = candidates[decision.choice.index]
            expected = (
                self.expected_queue(candidate, request.priority, definition.load_aware)
                if state.expects_queue
                else None
            )
            state = replace(
                state, cluster_id=candidate.cluster_id, expected_queue_ms=expected, choice=decision.choice
            )
            return state, Pick(candidate.cluster_id, state.failed_backend_ids)
        paced = held - HELD_UNPACED
        share = paced / HELD_ROUTES_PER_S * (0.5 + rng.random()) if paced > 0 else 0.0
        if isinstance(decision, Wait):
            pause = min(max(min(decision.ms / 1000.0, WAIT_POLL_CAP_S), share), wait_deadline - now)
            if pause > 0:
                return self._wait(state, pause, refusal)
        routing_deadline = _routing_deadline(request)
        if routing_deadline is not None and now < routing_deadline:
            poll = max(rng.randint(*UNAVAILABLE_POLL_MS) / 1000.0, share)
            return self._wait(state, min(poll, routing_deadline - now), refusal)
        if _requeues(state, now):
            # Refused as busier than this router saw, and the rest is full: queued where it was
            # refused, as when every cluster refused it (a canary holding a slot that the published
            # load leaves out had a burst the size of the fleet's slots answered 503).
            return self._route(_requeued(state), snapshot, now, rng, refusal, held)
        if request.max_wait_ms is None:
            reason = "no backend for this model can take the request now (x-max-wait-ms lets it wait)"
        else:
            reason = f"no backend for this model took the request within its {request.max_wait_ms} ms wait"
        return self._unroutable(state, snapshot, reason)

    def _wait(self, state: AttemptState, pause: float, refusal: str | None) -> tuple[AttemptState, Action]:
        """Sleep and route again, unless the request may not wait (``refusal``)."""
        if refusal is None:
            return _waited(state, pause)
        return state, Fail(RoutingError(refusal), "")

    def _unroutable(
        self, state: AttemptState, snapshot: Snapshot, reason: str = "no selectable backend for this model"
    ) -> tuple[AttemptState, Action]:
        if isinstance(snapshot, NoTarget) and not snapshot.advertised and not state.any_failure:
            return state, Fail(NoEligibleCandidates(), "")
        if state.any_failure:
            state = _noted(state, Exhausted("no_eligible_backend"))
        if state.broken is not None:
            return state, state.broken
        return state, Fail(RoutingError(reason, retry_after_ms=state.retry_after_ms), "")

    def _picked(
        self,
        state: AttemptState,
        backend: BackendRef | None,
        snapshot: Snapshot,
        now: float,
        rng: random.Random,
    ) -> tuple[AttemptState, Action]:
        if backend is None:
            state = replace(state, failed_cluster_ids=state.failed_cluster_ids | {state.cluster_id})
            return self._route(state, snapshot, now, rng)
        choice = state.choice
        state = replace(state, backend=backend, choice=None, reconnected=False)
        return state, Send(backend, state.expected_queue_ms, choice)

    # ---- attempts (§4.8) -----------------------------------------------------------------------

    def _answered(
        self, state: AttemptState, event: Answered, snapshot: Snapshot, now: float, rng: random.Random
    ) -> tuple[AttemptState, Action]:
        signal = event.signal
        if not signal.retryable:
            return state, Relay()
        state = replace(state, broken=None)
        if signal.retry_after_ms is not None:
            soonest = state.retry_after_ms
            if soonest is None or signal.retry_after_ms < soonest:
                state = replace(state, retry_after_ms=signal.retry_after_ms)
        if self._budget_spent(state, now):
            return _noted(state, Exhausted("retry_budget_exhausted")), Relay()
        backend = _current(state)
        mismatch = signal.reason == QUEUE_ESTIMATE_MISMATCH
        if mismatch:
            refused = (backend.inference_server_id, backend.cluster_id)
            state = replace(state, mismatched=state.mismatched | {refused})
        if state.request_retries >= self.settings.max_request_retries:
            if mismatch and event.readiness is Readiness.READY and _requeues(state, now):
                state = _noted(_requeued(state), Retried(signal.reason))
                return self._route(state, snapshot, now, rng)
            return _noted(state, Exhausted(signal.reason)), Relay()
        if event.readiness is Readiness.INCOMPLETE:
            return state, Relay()
        if event.readiness is Readiness.PAYLOAD_TOO_LARGE:
            return state, Fail(_too_large(), backend.inference_server_id)
        state = replace(state, request_retries=state.request_retries + 1)
        state = _noted(state, Retried(signal.reason))
        if mismatch:
            return _sibling(state, backend)
        # The backend too: a requeue brings back the cluster of a sibling that was only busier
        # than expected, and this one (an engine that died) was sent the request again.
        state = replace(
            state,
            failed_cluster_ids=state.failed_cluster_ids | {backend.cluster_id},
            failed_backend_ids=state.failed_backend_ids | {backend.inference_server_id},
        )
        return self._route(state, snapshot, now, rng)

    def _send_failed(self, state: AttemptState, event: SendFailed, now: float) -> tuple[AttemptState, Action]:
        backend = _current(state)
        backend_id = backend.inference_server_id
        if isinstance(event.error, UpstreamInvalid):  # it answered: the request ran
            return state, Fail(event.error, backend_id)
        if self._budget_spent(state, now):
            return _noted(state, Exhausted("retry_budget_exhausted")), Fail(event.error, backend_id)
        if state.connect_retries >= self.settings.max_connect_retries:
            return _noted(state, Exhausted("connect_retries_exhausted")), Fail(event.error, backend_id)
        if event.readiness is Readiness.INCOMPLETE:
            return state, Fail(event.error, backend_id)
        if event.readiness is Readiness.PAYLOAD_TOO_LARGE:
            return state, Fail(_too_large(), backend_id)
        state = replace(
            state, connect_retries=state.connect_retries + 1, broken=Fail(event.error, backend_id)
        )
        if isinstance(event.error, UpstreamTimeout | UpstreamBroken) or state.reconnected:
            # Failed again on a fresh connection: the backend drops it, not a stale connection.
            return _sibling(_noted(state, Retried("connect_failover")), backend)
        return _noted(state, Evicted(backend_id)), Reconnect(backend)

    def _reconnected(self, state: AttemptState, ok: bool) -> tuple[AttemptState, Action]:
        backend = _current(state)
        if ok:
            state = replace(_noted(state, Retried("hot_path_reconnect")), reconnected=True)
            return state, Send(backend, state.expected_queue_ms, None)
        return _sibling(_noted(state, Retried("connect_failover")), backend)

    def _budget_spent(self, state: AttemptState, now: float) -> bool:
        budget_ms = state.request.retry_budget_ms
        return budget_ms is not None and now >= state.request.received_at + budget_ms / 1000.0


def _requeues(state: AttemptState, now: float) -> bool:
    """Backends refused the request as busier than expected and its routing wait (``x-max-wait-ms``
    or ``--default-max-wait-ms``), if it has one, is not over: once, it is routed again instead of
    failed (not in the original, where it ends 429 or 503 while an engine could have queued it)."""
    deadline = _routing_deadline(state.request)
    return bool(state.mismatched) and state.expects_queue and (deadline is None or now < deadline)


def _routing_deadline(request: ProxyRequest) -> float | None:
    """When an explicit routing wait (``x-max-wait-ms`` or ``--default-max-wait-ms``) ends."""
    return None if request.max_wait_ms is None else request.received_at + request.max_wait_ms / 1000.0


def _requeued(state: AttemptState) -> AttemptState:
    """Routed again with the refusing backends back in, and sent without an expected queue, so
    Pylon queues it instead of refusing it again: every backend was busier than this router's
    view, which catches up within a heartbeat, and a wait decided on it still applies."""
    backend_ids = {backend_id for backend_id, _ in state.mismatched}
    cluster_ids = {cluster_id for _, cluster_id in state.mismatched}
    return replace(
        state,
        failed_backend_ids=state.failed_backend_ids - backend_ids,
        failed_cluster_ids=state.failed_cluster_ids - cluster_ids,
        expects_queue=False,
    )


def _sibling(state: AttemptState, failed: BackendRef) -> tuple[AttemptState, Action]:
    """Mark ``failed`` and pick another backend of its cluster (``Picked(None)`` → exclude the cluster)."""
    failed_ids = state.failed_backend_ids | {failed.inference_server_id}
    state = replace(state, failed_backend_ids=failed_ids, cluster_id=failed.cluster_id, choice=None)
    return state, Pick(failed.cluster_id, failed_ids)


def _waited(state: AttemptState, pause: float) -> tuple[AttemptState, Action]:
    return replace(state, routing_retry_attempts=state.routing_retry_attempts + 1), Sleep(pause)


def _noted(state: AttemptState, note: Note) -> AttemptState:
    return replace(state, notes=(*state.notes, note))


def _current(state: AttemptState) -> BackendRef:
    if state.backend is None:
        raise RuntimeError("attempt event without a backend")
    return state.backend


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge("request body exceeds the replay limit and cannot be retried")
