"""The routing loop (spec §4.7 with the timed decisions of the seed PR).

One call of ``Router.route`` turns a request into a chosen backend or a final routing failure. It
reads a fresh target snapshot on every pass, runs the input-work admission check and the policy,
and obeys the policy's decision:

* ``Selected`` → pick a backend in the chosen cluster (none left → exclude the cluster, re-route);
* ``Wait(d)`` → sleep ``min(d, 25 ms, wait_deadline - now)`` and route again; ``wait_deadline`` is
  arrival + ``x-max-wait-ms`` (capped at 60 s) or arrival + 60 s without the header;
* ``Unavailable`` (or a wait with no time left) → poll every 1-9 ms only while an explicit
  ``x-max-wait-ms`` deadline remains, otherwise fail.

When no candidate is eligible (none exist, or every one failed earlier in this request) routing
ends at once with the spec's classification: 404 ``no_eligible_candidates`` for a target nobody
advertises and nothing failed, else 503.

The loop talks to routing state through the small ``StateView`` seam so tests drive it with
in-memory fakes; time and randomness are injected.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from stargate.balancer.settings import AlgorithmDefinition, Policy
from stargate.balancer.types import Candidate, Choice, LbRequest, ModelStats, Selected, Target, Wait
from stargate.router.headers import MAX_WAIT_CAP_MS, ProxyRequest
from stargate.router.metrics import RouterMetrics

WAIT_POLL_CAP_S = 0.025
UNAVAILABLE_POLL_MS = (1, 9)
NO_ELIGIBLE_CANDIDATES = "no_eligible_candidates"
INPUT_WORK_LIMIT_EXCEEDED = "input_work_limit_exceeded"


class BackendRef(Protocol):
    """One admitted backend as the proxy needs it."""

    @property
    def inference_server_id(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def cluster_id(self) -> str: ...


class TargetSnapshot(Protocol):
    """An immutable view of one routing target with reservations applied."""

    @property
    def candidates(self) -> tuple[Candidate, ...]: ...
    def policy(self, definition: AlgorithmDefinition) -> Policy: ...
    def pick_backend(self, cluster_id: str, failed_backend_ids: AbstractSet[str]) -> BackendRef | None: ...


class StateView(Protocol):
    def view(self, target: Target) -> TargetSnapshot | None: ...
    def is_advertised(self, target: Target) -> bool: ...


AdmissionCheck = Callable[[AlgorithmDefinition, tuple[Candidate, ...], LbRequest], str | None]
"""``stargate.balancer.check_admission``: the rejection reason (a ``StrEnum``) or None to admit."""
ExpectedQueue = Callable[[ModelStats, int], int | None]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(slots=True)
class RequestProgress:
    """What one request has learned so far; shared by the routing loop and the retry logic."""

    failed_backend_ids: set[str] = field(default_factory=set)
    failed_cluster_ids: set[str] = field(default_factory=set)
    routing_retry_attempts: int = 0

    @property
    def any_failure(self) -> bool:
        return bool(self.failed_backend_ids or self.failed_cluster_ids)


@dataclass(frozen=True, slots=True)
class Routed:
    backend: BackendRef
    candidate: Candidate
    choice: Choice
    expected_queue_ms: int | None


@dataclass(frozen=True, slots=True)
class RoutingFailed:
    """A final routing outcome: 404 ``no_eligible_candidates``, 503 admission, or a plain 503."""

    status: int
    code: str | None = None
    exhausted: bool = False  # counts proxy_retry_exhausted_total{reason="no_eligible_backend"}


class Router:
    def __init__(
        self,
        state: StateView,
        metrics: RouterMetrics,
        *,
        admission: AdmissionCheck,
        expected_queue: ExpectedQueue,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._admission = admission
        self._expected_queue = expected_queue
        self._clock = clock
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()

    async def route(self, request: ProxyRequest, progress: RequestProgress) -> Routed | RoutingFailed:
        target = request.target
        definition = request.definition
        max_wait_s = None if request.max_wait_ms is None else request.max_wait_ms / 1000.0
        routing_deadline = None if max_wait_s is None else request.received_at + max_wait_s
        wait_deadline = request.received_at + (MAX_WAIT_CAP_MS / 1000.0 if max_wait_s is None else max_wait_s)
        while True:
            now = self._clock()
            view = self._state.view(target)
            candidates = view.candidates if view is not None else ()
            excluded = frozenset(progress.failed_cluster_ids)
            if view is None or all(c.cluster_id in excluded for c in candidates):
                return self._classify(target, progress, bool(candidates))
            lb_request = LbRequest(
                target=target,
                input_tokens=request.input_tokens,
                received_at=request.received_at,
                now=now,
                priority=request.priority,
                cache_affinity_key=request.cache_affinity_key,
                request_slo_ms=request.request_slo_ms,
                excluded=excluded,
            )
            if definition.max_input_work_seconds is not None:
                rejection = self._admission(definition, candidates, lb_request)
                if rejection is not None:
                    self._metrics.admission_rejected(target, str(rejection))
                    return RoutingFailed(503, INPUT_WORK_LIMIT_EXCEEDED)
            decision = view.policy(definition).decide(candidates, lb_request, self._rng)
            if isinstance(decision, Selected):
                candidate = candidates[decision.choice.index]
                backend = view.pick_backend(candidate.cluster_id, progress.failed_backend_ids)
                if backend is None:
                    progress.failed_cluster_ids.add(candidate.cluster_id)
                    continue
                choice = decision.choice
                self._metrics.selection(
                    target,
                    definition.algorithm.value,
                    choice.rank_depth,
                    choice.selected_after_kv_free_tokens_skip,
                )
                expected = self._expected_queue(candidate.stats, request.priority)
                return Routed(backend, candidate, choice, expected)
            if isinstance(decision, Wait):
                pause = min(decision.ms / 1000.0, WAIT_POLL_CAP_S, wait_deadline - now)
                if pause > 0:
                    await self._sleep(pause)
                    progress.routing_retry_attempts += 1
                    continue
            if routing_deadline is not None and now < routing_deadline:
                pause = min(self._rng.randint(*UNAVAILABLE_POLL_MS) / 1000.0, routing_deadline - now)
                await self._sleep(pause)
                progress.routing_retry_attempts += 1
                continue
            return self._classify(target, progress, bool(candidates))

    def _classify(self, target: Target, progress: RequestProgress, has_candidates: bool) -> RoutingFailed:
        if not has_candidates and not progress.any_failure and not self._state.is_advertised(target):
            return RoutingFailed(404, NO_ELIGIBLE_CANDIDATES)
        return RoutingFailed(503, exhausted=progress.any_failure)
