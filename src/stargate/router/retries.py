"""Attempt execution and retry rules (spec §4.8).

``AttemptRunner.run`` drives one request from routing to a final outcome: it routes, reserves,
sends, and on a transport failure or a retryable upstream rejection decides between retrying the
same backend, a sibling in the same cluster, or re-routing with the cluster excluded. A request
that was not executed upstream is always retried or answered with a final status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from multidict import CIMultiDict

from stargate.balancer.types import Target
from stargate.errors import UpstreamError
from stargate.router.headers import ProxyRequest
from stargate.router.metrics import RouterMetrics
from stargate.router.replay import Readiness, ReplayBody
from stargate.router.routing import BackendRef, RequestProgress, Router, RoutingFailed, StateView
from stargate.router.transport import Transport, UpstreamResponse

RETRYABLE_STATUSES = frozenset({429, 503})
QUEUE_ESTIMATE_MISMATCH = "queue_estimate_mismatch"
DEFAULT_RETRY_REASON = "retryable_upstream_response"
EXPECTED_QUEUE_HEADER = "x-stargate-expected-queue-ms"


@dataclass(frozen=True, slots=True)
class RetrySettings:
    max_connect_retries: int = 2
    max_request_retries: int = 2
    require_pylon_retry_signal: bool = True


@dataclass(frozen=True, slots=True)
class RetrySignal:
    """How an upstream answer reads: retryable with a reason, and whether to drop the reservation."""

    retryable: bool
    reason: str
    release_reservation: bool


def retry_signal(status: int, header: Callable[[str], str | None], require_signal: bool) -> RetrySignal:
    flag = header("x-stargate-retryable")
    raw_reason = header("x-stargate-retry-reason")
    reason = (raw_reason or "").strip() or DEFAULT_RETRY_REASON
    explicit_true = flag is not None and flag.strip().lower() == "true"
    release = status == 429 and explicit_true and reason == QUEUE_ESTIMATE_MISMATCH
    if status not in RETRYABLE_STATUSES:
        return RetrySignal(False, reason, release)
    retryable = explicit_true if flag is not None else not require_signal
    return RetrySignal(retryable, reason, release)


class Reserving(StateView, Protocol):
    def reserve(self, target: Target, backend_id: str, input_tokens: int, priority: int) -> Any: ...
    def release(self, reservation: Any) -> None: ...
    def first_byte(self, reservation: Any) -> None: ...
    def finish(self, reservation: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Final: stream this upstream response to the client; the relay reports its first body byte
    and its end through ``AttemptRunner.first_byte`` / ``finish`` (the in-flight count)."""

    response: UpstreamResponse
    backend: BackendRef
    reservation: Any = None


@dataclass(frozen=True, slots=True)
class LocalFailure:
    """Final: Stargate answers itself. ``backend_id`` is "" for routing failures."""

    status: int
    code: str | None
    message: str
    backend_id: str


Outcome = Passthrough | LocalFailure


class AttemptRunner:
    def __init__(
        self,
        state: Reserving,
        router: Router,
        transport: Transport,
        metrics: RouterMetrics,
        settings: RetrySettings,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._router = router
        self._transport = transport
        self._metrics = metrics
        self._settings = settings
        self._clock = clock

    async def run(
        self,
        request: ProxyRequest,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        replay: ReplayBody,
    ) -> Outcome:
        target, metrics, settings = request.target, self._metrics, self._settings
        progress = RequestProgress()
        routing_started = self._clock()
        routing_observed = False
        retry_deadline = (
            None
            if request.retry_budget_ms is None
            else request.received_at + request.retry_budget_ms / 1000.0
        )
        connect_retries = request_retries = 0
        backend: BackendRef | None = None
        expected: int | None = None
        while True:
            if backend is None:
                routed = await self._router.route(request, progress)
                if isinstance(routed, RoutingFailed):
                    if routed.exhausted:
                        metrics.retry_exhausted(target, "no_eligible_backend")
                    return LocalFailure(routed.status, routed.code, _routing_message(routed), "")
                backend, expected = routed.backend, routed.expected_queue_ms
                if not routing_observed:
                    metrics.routing_duration(target, self._clock() - routing_started)
                    routing_observed = True
            backend_id = backend.inference_server_id
            reservation = self._state.reserve(target, backend_id, request.input_tokens, request.priority)
            attempt_headers = headers.copy()
            if expected is not None:
                attempt_headers[EXPECTED_QUEUE_HEADER] = str(expected)
            try:
                response = await self._transport.send(
                    backend, method, path_qs, attempt_headers, replay.body()
                )
            except UpstreamError:
                self._state.finish(reservation)
                metrics.attempt(target, backend_id, "proxy_502")
                metrics.replay_buffer(target, replay.buffered)
                if retry_deadline is not None and self._clock() >= retry_deadline:
                    metrics.retry_exhausted(target, "retry_budget_exhausted")
                    return _transport_failure(backend_id)
                if connect_retries >= settings.max_connect_retries:
                    metrics.retry_exhausted(target, "connect_retries_exhausted")
                    return _transport_failure(backend_id)
                readiness = replay.readiness()
                if readiness is Readiness.INCOMPLETE:
                    return _transport_failure(backend_id)
                if readiness is Readiness.PAYLOAD_TOO_LARGE:
                    return _too_large(backend_id)
                connect_retries += 1
                metrics.eviction(backend_id, "proxy_error")
                reconnected = await self._transport.reconnect(backend)
                metrics.reconnect(backend_id, reconnected)
                if reconnected:
                    metrics.retry(target, "hot_path_reconnect")
                    continue
                metrics.retry(target, "connect_failover")
                backend = self._sibling(target, backend, progress)
                continue
            metrics.attempt(target, backend_id, f"upstream_{response.status}")
            metrics.replay_buffer(target, replay.buffered)
            metrics.proxy_duration(target, backend_id, self._clock() - request.received_at)
            signal = retry_signal(response.status, response.header, settings.require_pylon_retry_signal)
            if signal.release_reservation:
                self._state.release(reservation)
            final = Passthrough(response, backend, reservation)
            if not signal.retryable:
                return final
            if retry_deadline is not None and self._clock() >= retry_deadline:
                metrics.retry_exhausted(target, "retry_budget_exhausted")
                return final
            if request_retries >= settings.max_request_retries:
                metrics.retry_exhausted(target, signal.reason)
                return final
            readiness = replay.readiness()
            if readiness is Readiness.INCOMPLETE:
                return final
            response.release()
            self._state.finish(reservation)
            if readiness is Readiness.PAYLOAD_TOO_LARGE:
                return _too_large(backend_id)
            request_retries += 1
            metrics.retry(target, signal.reason)
            if signal.reason == QUEUE_ESTIMATE_MISMATCH:
                backend = self._sibling(target, backend, progress)
            else:
                progress.failed_cluster_ids.add(backend.cluster_id)
                backend = None

    def first_byte(self, outcome: Passthrough) -> None:
        self._state.first_byte(outcome.reservation)

    def finish(self, outcome: Passthrough) -> None:
        self._state.finish(outcome.reservation)

    def _sibling(self, target: Target, failed: BackendRef, progress: RequestProgress) -> BackendRef | None:
        """Mark ``failed`` and pick another backend of its cluster; None → re-route without the cluster."""
        progress.failed_backend_ids.add(failed.inference_server_id)
        view = self._state.view(target)
        sibling = (
            view.pick_backend(failed.cluster_id, progress.failed_backend_ids) if view is not None else None
        )
        if sibling is None:
            progress.failed_cluster_ids.add(failed.cluster_id)
        return sibling


def _routing_message(failed: RoutingFailed) -> str:
    if failed.status == 404:
        return "no eligible candidates"
    if failed.code is not None:
        return "input work admission limit exceeded"
    return "no selectable backend for this model"


def _transport_failure(backend_id: str) -> LocalFailure:
    return LocalFailure(502, None, "upstream transport failed", backend_id)


def _too_large(backend_id: str) -> LocalFailure:
    return LocalFailure(413, None, "request body exceeds the replay limit and cannot be retried", backend_id)
