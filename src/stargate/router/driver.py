"""The attempt driver: performs the attempt machine's actions and records every proxy metric.

``AttemptDriver.run`` feeds the pure ``AttemptMachine`` (``router/attempt.py``) a fresh routing
snapshot and the clock at each step, does what the returned action says (pick a backend, sleep,
send, reconnect) and hands the result back as the next event, until the machine answers ``Relay``
or ``Fail``. It holds no policy: every decision is the machine's, every metric and reservation is
recorded here.

On ``Relay`` the driver waits for the response's first body byte before it hands the response
over: until then the client has been told nothing, so a backend that dies while it prefills (the
longest silent stretch of a request) costs a retry elsewhere, not a cut stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from multidict import CIMultiDict
from yarl import URL

from stargate.balancer.types import Target
from stargate.errors import StargateError, UpstreamBroken, UpstreamError, UpstreamNotSent, UpstreamTimeout
from stargate.router.attempt import (
    AdmissionRejected,
    Answered,
    AttemptMachine,
    Event,
    Evicted,
    Exhausted,
    NoTarget,
    Note,
    Pick,
    Picked,
    Reconnect,
    Reconnected,
    Relay,
    Retried,
    Send,
    SendFailed,
    Sleep,
    Snapshot,
    Start,
    TargetSnapshot,
    Woke,
    start,
)
from stargate.router.headers import ProxyRequest
from stargate.router.metrics import RouterMetrics
from stargate.router.replay import Readiness, ReplayBody
from stargate.router.retry_signal import retry_signal
from stargate.router.transport import BackendRef, Transport, UpstreamResponse
from stargate.tracing import RouteTrace
from stargate.wire import headers as h
from stargate.wire.sse import FirstOutput

RESPONSES_PATH = "/v1/responses"

log = logging.getLogger(__name__)


class RoutingStateView(Protocol):
    """What the driver needs of ``RoutingState``: snapshots and each attempt's reservation, which
    ``finish`` ends (in-flight count and optimistic load) whatever the attempt's outcome."""

    def view(self, target: Target) -> TargetSnapshot | None: ...
    def is_advertised(self, target: Target) -> bool: ...
    @property
    def starting(self) -> bool: ...
    def reserve(
        self,
        target: Target,
        backend_id: str,
        input_tokens: int,
        priority: int,
        prefill_tokens: int | None,
        key: str | None,
    ) -> Any: ...
    def release(self, reservation: Any) -> None: ...
    def first_byte(
        self, reservation: Any, answered: bool = True, prefilled: bool = True, ran: bool = True
    ) -> None: ...
    def prefilled(self, reservation: Any) -> None: ...
    def finish(self, reservation: Any) -> None: ...
    def answered(self, reservation: Any) -> None: ...
    def server_error(self, reservation: Any) -> None: ...


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Final: stream this upstream response to the client, ``first`` (its first body bytes; None
    for an empty body) then ``rest``; the relay reports the end through ``AttemptDriver.finish``
    (the in-flight count)."""

    response: UpstreamResponse
    backend: BackendRef
    first: bytes | None
    rest: AsyncIterator[bytes]
    reservation: Any = None


@dataclass(frozen=True, slots=True)
class LocalFailure:
    """Final: Stargate answers ``error`` itself. ``backend_id`` is "" for routing failures."""

    error: StargateError
    backend_id: str

    @property
    def status(self) -> int:
        return self.error.status


Outcome = Passthrough | LocalFailure


class AttemptDriver:
    def __init__(
        self,
        state: RoutingStateView,
        machine: AttemptMachine,
        transport: Transport,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._state = state
        self._machine = machine
        self._transport = transport
        self._metrics = metrics
        self._clock = clock
        self._sleep = sleep
        self._rng = rng if rng is not None else random.Random()
        self._require_signal = machine.settings.require_pylon_retry_signal
        self._holding = 0
        """Requests asleep between routing passes, the ones held waiting for room
        (``RetrySettings.max_held_requests``)."""
        self._none_held = asyncio.Event()
        self._none_held.set()
        self._closing = False

    async def release_held(self, timeout_s: float) -> None:
        """The router is about to stop: every held request (and any that would wait) ends with a
        503 at its next routing pass, which comes within one poll; returns once none is held (or
        after ``timeout_s``)."""
        self._closing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._none_held.wait(), timeout_s)

    async def run(
        self,
        request: ProxyRequest,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        replay: ReplayBody,
        trace: RouteTrace | None = None,
    ) -> Outcome:
        """``trace``, when given, receives the routing facts for the request's span and the
        backend it is at."""
        target, clock = request.target, self._clock
        state = start(request)
        event: Event = Start(self._holding, self._closing)
        response: UpstreamResponse | None = None
        reservation: Any = None
        routing_started: float | None = clock()
        while True:
            snapshot = self._snapshot(target)
            state, action = self._machine.step(state, event, snapshot, clock(), self._rng)
            if state.notes:
                self._noted(target, state.notes, trace)
            if response is not None and not isinstance(action, Relay):
                response.release()
                self._state.finish(reservation)
                response = None
                if trace is not None:
                    trace.at_backend = ""
            if isinstance(action, Pick):
                picked = None
                if not isinstance(snapshot, NoTarget):
                    picked = snapshot.pick_backend(action.cluster_id, action.failed_backend_ids)
                event = Picked(picked)
            elif isinstance(action, Sleep):
                self._holding += 1
                self._none_held.clear()
                try:
                    await self._sleep(action.seconds)
                finally:
                    self._holding -= 1
                    if self._holding == 0:
                        self._none_held.set()
                if trace is not None:
                    trace.waited_s += action.seconds
                event = Woke(self._closing, self._holding)
            elif isinstance(action, Send):
                if routing_started is not None:
                    self._metrics.routing_duration(target, clock() - routing_started)
                    routing_started = None
                reservation = self._reserve(request, action, trace)
                if trace is not None:
                    trace.at_backend = action.backend.inference_server_id
                event, response = await self._send(
                    request, action, reservation, method, path_qs, headers, replay
                )
                if trace is not None and response is None:
                    trace.at_backend = ""
            elif isinstance(action, Reconnect):
                ok = await self._transport.reconnect(action.backend)
                self._metrics.reconnect(action.backend.inference_server_id, ok)
                event = Reconnected(ok)
            elif isinstance(action, Relay):
                assert response is not None and state.backend is not None
                rest = response.chunks()
                try:
                    first = await anext(rest, None)
                except UpstreamError as exc:
                    event = self._broken(request, state.backend, reservation, exc, replay)
                    continue
                except asyncio.CancelledError:  # the wait can be long: never leak the in-flight count
                    response.release()
                    self._state.finish(reservation)
                    raise
                if first is not None:
                    watch = _first_output_watch(path_qs, response)
                    prefilled = watch is None or watch.feed(first)
                    status = response.status
                    ran = 200 <= status < 300
                    self._state.first_byte(reservation, answered=status < 500, prefilled=prefilled, ran=ran)
                    if watch is not None and not prefilled:
                        rest = self._until_output(rest, watch, reservation)
                return Passthrough(response, state.backend, first, rest, reservation)
            else:
                return LocalFailure(action.error, action.backend_id)

    def _reserve(self, request: ProxyRequest, action: Send, trace: RouteTrace | None) -> Any:
        """Count the selection and reserve the attempt in routing state (optimistic load, in flight)."""
        backend, choice = action.backend, action.choice
        if choice is not None:
            self._metrics.selection(
                request.target,
                request.definition.algorithm.value,
                choice.rank_depth,
                choice.selected_after_kv_free_tokens_skip,
            )
        if trace is not None:
            trace.attempts += 1
            trace.backend_id, trace.cluster_id = backend.inference_server_id, backend.cluster_id
            if choice is not None:
                trace.rank_depth = choice.rank_depth
        prefill_tokens = choice.prefill_tokens if choice is not None else None
        tokens, key = request.input_tokens, request.cache_affinity_key
        return self._state.reserve(
            request.target, backend.inference_server_id, tokens, request.priority, prefill_tokens, key
        )

    async def _send(
        self,
        request: ProxyRequest,
        action: Send,
        reservation: Any,
        method: str,
        path_qs: str,
        headers: CIMultiDict[str],
        replay: ReplayBody,
    ) -> tuple[Event, UpstreamResponse | None]:
        """One upstream attempt; the answer (or the failure) as the machine's next event."""
        target, metrics, backend = request.target, self._metrics, action.backend
        backend_id = backend.inference_server_id
        attempt_headers = headers.copy()
        if action.expected_queue_ms is not None:
            attempt_headers[h.EXPECTED_QUEUE_MS] = str(action.expected_queue_ms)
        try:
            response = await self._transport.send(backend, method, path_qs, attempt_headers, replay.body())
        except UpstreamError as exc:
            self._state.finish(reservation)
            sent_whole = replay.readiness() is Readiness.READY
            if sent_whole and not isinstance(exc, UpstreamNotSent | UpstreamTimeout):
                # Sent whole, then dropped unanswered: the backend's doing, unlike a body its client
                # broke, a connection this router could not get (its pool, its late event loop) or
                # a wait it gave up on.
                self._state.server_error(reservation)
            metrics.attempt(target, backend_id, "proxy_502")
            metrics.replay_buffer(target, replay.buffered)
            return SendFailed(exc, replay.readiness()), None
        except asyncio.CancelledError:  # the client hung up while the backend had not answered
            self._state.finish(reservation)
            metrics.attempt(target, backend_id, "proxy_499")
            metrics.replay_buffer(target, replay.buffered)
            raise
        status = response.status
        metrics.attempt(target, backend_id, f"upstream_{status}")
        metrics.replay_buffer(target, replay.buffered)
        metrics.proxy_duration(target, backend_id, self._clock() - request.received_at)
        signal = retry_signal(status, response.header, self._require_signal)
        if signal.release_reservation:
            self._state.release(reservation)
        return Answered(status, signal, replay.readiness()), response

    def _broken(
        self,
        request: ProxyRequest,
        backend: BackendRef,
        reservation: Any,
        exc: UpstreamError,
        replay: ReplayBody,
    ) -> SendFailed:
        """The answer's body broke before its first byte: the client has nothing yet, retry it."""
        log.warning(
            "backend %s broke its response to request %s before the first byte: %s",
            backend.inference_server_id,
            request.request_id,
            exc,
        )
        message = f"backend {backend.inference_server_id} broke its response before the first byte"
        self._state.server_error(reservation)
        return SendFailed(UpstreamBroken(message), replay.readiness())

    def finish(self, outcome: Passthrough, cut: bool = False) -> None:
        """The relay ended; ``cut``: the backend broke the answer after its first byte. That, a
        server error or a 429 without the retry signal counts toward the backend's hold for the
        model (a backend that answers them at once looks idle and draws the traffic); another
        answer starts its row again, and a retryable refusal (relayed once retries ran out) neither."""
        status, header = outcome.response.status, outcome.response.header
        retryable = retry_signal(status, header, self._require_signal).retryable
        if cut or (not retryable and (status >= 500 or status == 429)):
            self._state.server_error(outcome.reservation)
        elif not retryable:
            self._state.answered(outcome.reservation)
        self._state.finish(outcome.reservation)

    async def _until_output(
        self, rest: AsyncIterator[bytes], watch: FirstOutput, reservation: Any
    ) -> AsyncIterator[bytes]:
        """``rest``, ending the attempt's prefill in routing state at its first output event."""
        async for chunk in rest:
            if not watch.seen and watch.feed(chunk):
                self._state.prefilled(reservation)
            yield chunk

    def _snapshot(self, target: Target) -> Snapshot:
        view = self._state.view(target)
        return view if view is not None else NoTarget(self._state.is_advertised(target), self._state.starting)

    def _noted(self, target: Target, notes: tuple[Note, ...], trace: RouteTrace | None) -> None:
        """The machine's notes of one step as metrics (and retry reasons on the request's span)."""
        if trace is not None:
            trace.retry_reasons.extend(n.reason for n in notes if isinstance(n, Retried))
        metrics = self._metrics
        for note in notes:
            if isinstance(note, Retried):
                metrics.retry(target, note.reason)
            elif isinstance(note, Exhausted):
                metrics.retry_exhausted(target, note.reason)
            elif isinstance(note, Evicted):
                metrics.eviction(note.backend_id, "proxy_error")
            elif isinstance(note, AdmissionRejected):
                metrics.admission_rejected(target, note.reason)


def _first_output_watch(path_qs: str, response: UpstreamResponse) -> FirstOutput | None:
    """A watch for a Responses API event stream, whose first bytes are not its first token: an
    engine sends ``response.created`` and ``response.in_progress`` as it takes the request, before
    its prefill, and a prefill taken as ended there hid that prompt's work from load-aware
    routing. Other answers' first byte is their first token (or all of them)."""
    path = path_qs.partition("?")[0]
    if "%" in path:
        path = URL(path, encoded=True).path  # decoded, as the router matched it
    if response.status >= 300 or path != RESPONSES_PATH:
        return None
    content_type = response.header("content-type") or ""
    return FirstOutput() if content_type.startswith("text/event-stream") else None
