"""The HTTP listener Stargate sends requests to, and the relay to the engine (spec pylon.md §7).

Order per request: health shortcut → required headers → generation gate → observer (live as
pending) → body (≤ 64 MiB) → body rules → local queue admission → forward → relay chunk by
chunk with ``iter_any`` while the observer scans the bytes → finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from stargate.body_coding import content_coding, decoded, off_loop
from stargate.errors import (
    BodyBufferFull,
    EngineBodyBufferFull,
    LocalConnectFailure,
    ModelNotAdmitted,
    PayloadTooLarge,
    QueueEstimateMismatch,
    RequestError,
    StargateError,
)
from stargate.pylon import admission
from stargate.pylon.config import PylonSettings, UpstreamBackend
from stargate.pylon.headers import (
    RequestMeta,
    RetryPolicy,
    parse_request_meta,
    response_headers,
    upstream_headers,
)
from stargate.pylon.health import HealthProber
from stargate.pylon.load import LiveLoad, Phase
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.models import Generation, ModelRegistry
from stargate.pylon.observer import PROGRESS_INTERVAL_S, RequestObserver, SseScanner, json_usage
from stargate.pylon.stats.hub import StatsHub
from stargate.pylon.stats.observation import Endpoint, Observation, State, embedding_item_count
from stargate.responses import error_response
from stargate.wire import headers as h
from stargate.wire import json_body
from stargate.wire.address import join_host_port
from stargate.wire.body_budget import BodyBudget
from stargate.wire.client_faults import ClientFaults, detail
from stargate.wire.clock import Clock
from stargate.wire.http_client import failure_text
from stargate.wire.http_server import expectation_problem, report_client_gone, request_target, send_continue
from stargate.wire.limits import HOP_HEADER_FIELDS, MAX_BODY_BYTES, MAX_REQUEST_HEADER_FIELDS
from stargate.wire.sse import MAX_PENDING_EVENT, EventTooLarge

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

    from stargate.otel import Span, Tracing

log = logging.getLogger(__name__)
MAX_BODY = MAX_BODY_BYTES
ENDPOINTS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/responses": Endpoint.RESPONSES,
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    "/v1/completions": Endpoint.COMPLETIONS,
}
PYLON_HEADER_FIELDS = MAX_REQUEST_HEADER_FIELDS + HOP_HEADER_FIELDS
"""What a router took, with what it added."""
MAX_OBSERVED_JSON = 1024 * 1024  # a JSON answer larger than this is relayed without reading its usage
_RELAY_HINT = "pylon --pylon-relay-non-streaming true relays JSON answers"


ENGINE_PROBE_TIMEOUT_S = 0.5
ENGINE_PROBE_RETRY_S = 0.02


async def engine_gone(url: str, path: str) -> bool:
    """True when the engine's address refuses connections within ``ENGINE_PROBE_TIMEOUT_S``: the
    process is gone and runs nothing. A killed process still completes TCP handshakes until the
    kernel has torn its sockets down, so a fresh connection dropped before it answers ``GET path``
    is tried again; an answer (any status), or no refusal within the bound, means it may still be
    running the request: False."""
    target = URL(url)
    if target.host is None or target.port is None:
        return False
    try:
        async with asyncio.timeout(ENGINE_PROBE_TIMEOUT_S):
            while (verdict := await _probe_once(target.host, target.port, path)) is None:
                await asyncio.sleep(ENGINE_PROBE_RETRY_S)
    except TimeoutError:
        return False
    return verdict


async def _probe_once(host: str, port: int, path: str) -> bool | None:
    """True: refused; False: answered (or an unexpected error); None: accepted, dropped unanswered."""
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        head = f"GET {path} HTTP/1.1\r\nHost: {join_host_port(host, port)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode())
        await writer.drain()
        return False if await reader.read(1) else None
    except ConnectionRefusedError:
        return True
    except (ConnectionResetError, BrokenPipeError):
        return None
    except OSError:
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


@dataclass(frozen=True, slots=True)
class RelayTimeouts:
    """``read_s``: the longest wait for the engine's response and its body's first byte. An engine
    sends a non-streamed answer whole at its end, and a streamed one nothing while the request waits
    in its queue and prefills, so this is a backstop for an engine that hangs (Stargate's health
    probes take its backend out of routing within seconds), not a bound on a generation. Once the
    body began, ``between_s`` of silence ends it (the original's 30 s between reads)."""

    connect_s: float = 10.0
    read_s: float = 1800.0
    between_s: float = 30.0


class _Stall:
    """Closes an upstream response that will not end on its own while the relay waits for it: its
    body began and then sent nothing for ``limit_s`` (time spent writing to a slow client does not
    count), or its connection is gone short of the body's end (aiohttp's C parser drops a malformed
    chunk without failing the read, which then waited for ``read_s``). After the whole process
    was stopped (SIGSTOP, a paused VM) the check runs late, before the relay has read what
    arrived meanwhile, and it cut streams the engine had finished: a late check only re-arms, and
    bytes that reached the connection since the relay began to wait count as an answer."""

    __slots__ = ("_began", "_check_handle", "_due", "_fed", "_limit_s", "_loop", "_since", "_upstream")

    def __init__(
        self, upstream: aiohttp.ClientResponse, limit_s: float, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self._upstream = upstream
        self._limit_s = limit_s
        self._loop = loop or asyncio.get_running_loop()
        self._since: float | None = self._loop.time()  # waiting for the first chunk
        self._fed = upstream.content.total_bytes
        self._began = False
        self._due = self._loop.time() + limit_s / 3
        self._check_handle = self._loop.call_at(self._due, self._check)

    def waiting(self) -> None:
        """The relay waits for the next chunk."""
        self._since = self._loop.time()
        self._fed = self._upstream.content.total_bytes

    def arrived(self) -> None:
        self._since = None
        self._began = True

    def _check(self) -> None:
        now = self._loop.time()
        late = now - self._due > self._limit_s / 3
        since = self._since
        silent = not late and (
            self._began
            and since is not None
            and now - since >= self._limit_s
            and self._upstream.content.total_bytes == self._fed
            and not self._upstream.content.is_eof()
        )
        if since is not None and (silent or self._cut_off()):
            self._upstream.close()  # the pending read fails: the relay aborts the stream
            return
        self._due = now + self._limit_s / 3
        self._check_handle = self._loop.call_at(self._due, self._check)

    def _cut_off(self) -> bool:
        connection = self._upstream.connection
        return connection is not None and connection.transport is None and not self._upstream.content.is_eof()

    def stop(self) -> None:
        self._check_handle.cancel()


class Relay:
    def __init__(
        self,
        *,
        settings: PylonSettings,
        session: aiohttp.ClientSession,
        registry: ModelRegistry,
        hub: StatsHub,
        load: LiveLoad,
        metrics: PylonMetrics,
        clock: Clock,
        prober: HealthProber,
        timeouts: RelayTimeouts = RelayTimeouts(),
        tracing: Tracing | None = None,
        client_faults: ClientFaults | None = None,
        control_session: aiohttp.ClientSession | None = None,
    ) -> None:
        """``session``: relayed requests; ``control_session`` (default: the same): a forwarded
        ``/health``, which must not queue behind relayed requests for a connection."""
        self.s = settings
        self.faults = client_faults or ClientFaults(logging.getLogger("stargate.pylon.clients"))
        self.tracing = tracing
        self.session = session
        self.control_session = control_session or session
        self.registry = registry
        self.hub = hub
        self.load = load
        self.metrics = metrics
        self.clock = clock
        self.prober = prober
        # A body waits for room as long as it may pause while sent (0: for ever).
        self.bodies = BodyBudget(
            settings.max_buffered_body_bytes, settings.http_body_read_timeout_ms / 1000.0 or None
        )
        metrics.watch_body_budget(self.bodies)
        self._produced: dict[str, float] = {}  # model id -> when the engine last produced output for it
        self.between_s = timeouts.between_s
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeouts.connect_s, sock_read=timeouts.read_s
        )
        self.retry_policy = RetryPolicy(
            settings.retryable_statuses,
            settings.require_upstream_retry_header,
            settings.upstream_retry_header,
            settings.propagate_retry_after,
        )
        self.admission = admission.AdmissionConfig(
            settings.queue_mismatch_enabled,
            settings.queue_mismatch_min_delta_ms,
            settings.queue_mismatch_tolerance_factor,
            settings.queue_mismatch_retry_after_ms,
        )
        self._ceiling = (
            settings.priority_ceiling if settings.upstream_backend is UpstreamBackend.DYNAMO else None
        )

    def produced_within(self, model_id: str, seconds: float) -> bool:
        """Whether the engine produced output for ``model_id`` (a token, or a completed answer)
        within the last ``seconds``: a canary it answers late is queued, not failed. An answer being
        streamed reports its progress once per ``PROGRESS_INTERVAL_S``, so its tokens are that much
        older than what is known of them: with a canary timeout of 1 s or less, one queued behind a
        decoding answer failed."""
        at = self._produced.get(model_id)
        return at is not None and self.clock.monotonic() - at <= seconds + PROGRESS_INTERVAL_S

    def work_ahead_s(self, gen: Generation) -> float:
        """Seconds of prompt work the engine has in hand for ``gen`` at the measured input rate (0
        when unknown): a request sent now, a canary too, waits behind it in the engine's queue."""
        ahead = self.load.estimates(gen, self.hub.input_tps(gen))
        return max(ahead.values(), default=0) / 1000.0 if ahead else 0.0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=self.expect)
        return app

    def record(self, obs: Observation) -> None:
        """Observer sink: phases into the queue table, numbers into the stats hub."""
        if obs.state is State.INPUT_PROCESSING:
            self.load.advance(obs.request_id, Phase.INPUT_PROCESSING)
        elif obs.state is State.OUTPUT_GENERATION:
            self._produced[obs.generation.model_id] = self.clock.monotonic()
            self.load.advance(obs.request_id, Phase.OUTPUT_GENERATION)
        elif obs.state.terminal:
            if obs.state is State.COMPLETE:
                self._produced[obs.generation.model_id] = self.clock.monotonic()
            self.load.release(obs.request_id)
            self.metrics.request_finished(obs)
        elif obs.state is State.UPSTREAM_CONNECTING:
            self.metrics.request_started(obs.generation.model_id)
        self.hub.on_observation(obs)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` gets its 100 only past the checks the head allows (RFC 9110
        §10.1.1): told to go ahead, a client sent a body up to the limit only to see it refused."""
        head = expectation_problem(request) or (None if request.path == "/health" else self._head(request))
        if isinstance(head, StargateError):
            return _problem(head)  # a body sent all the same is read and dropped
        await send_continue(request)
        return None

    def _head(self, request: web.Request) -> tuple[RequestMeta, Generation] | StargateError:
        """What the request's head says, or what is wrong with it (before its body is read)."""
        if (too_many := h.too_many_fields(len(request.headers), PYLON_HEADER_FIELDS)) is not None:
            return RequestError(too_many)
        if any(segment in (".", "..") for segment in request.path.split("/")):
            # The engine's URL resolves them: /v1/./chat/completions is its chat endpoint, which
            # this path would reach past the endpoint's rules, load count and stats.
            return RequestError("the request path must not contain . or .. segments")
        try:
            meta = parse_request_meta(request.headers)
        except RequestError as exc:
            return exc
        gen = self.registry.admitted(meta.model)
        if gen is None:
            return ModelNotAdmitted()
        declared = request.content_length
        if declared is not None and declared > MAX_BODY:
            return PayloadTooLarge(f"request body exceeds {MAX_BODY} bytes")
        return meta, gen

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health":
            return await self._forward_health(request)
        head = self._head(request)
        if isinstance(head, StargateError):
            return _problem(head)
        meta, gen = head
        # The body is in before the request counts: one that trickles in is no load on the engine,
        # and counted as queued it made the backend look full to every router.
        body = await self._read_body(request, meta.request_id)
        if isinstance(body, web.Response):
            return body
        try:
            return await self._handle_read(request, meta, gen, body)
        finally:
            self.bodies.give(len(body))

    async def _read_body(self, request: web.Request, request_id: str) -> bytes | web.Response:
        """The whole request body, within ``MAX_BODY`` and the buffer budget, or the answer."""
        try:
            return await self.bodies.read_whole(request, MAX_BODY)
        except BodyBufferFull as exc:
            return _problem(EngineBodyBufferFull(exc))
        except PayloadTooLarge:
            return _problem(PayloadTooLarge(f"request body exceeds {MAX_BODY} bytes"))
        except ConnectionError:
            # Nobody is left to read an answer: the request ends here, logged once, never sent on.
            report_client_gone(self.faults, request, request_id, started=False)
            return _problem(RequestError("client closed the connection before the request body was complete"))

    async def _handle_read(
        self, request: web.Request, meta: RequestMeta, gen: Generation, body: bytes
    ) -> web.StreamResponse:
        endpoint = ENDPOINTS.get(request.path) if request.method == "POST" else None
        observer: RequestObserver | None = None
        key = h.text_value(request.headers.get(h.CACHE_AFFINITY_KEY))  # the router's key, or none
        request_id = meta.request_id  # the engine gets the client's; Pylon counts each request once
        if endpoint is not None:
            request_id = self.load.unique_key(meta.request_id)
            self.load.track(request_id, gen, meta.priority or 0, meta.input_tokens, key)
            self.hub.on_request_tracked(request_id, gen)
            observer = RequestObserver(
                request_id=request_id,
                generation=gen,
                endpoint=endpoint,
                input_tokens=meta.input_tokens,
                clock=self.clock,
                sink=self.record,
            )
        span = None
        if self.tracing is not None:
            span = self.tracing.start(
                "pylon_request", request.headers, {"request.id": meta.request_id, "model": gen.model_id}
            )
        status = 500
        try:
            response = await self._admit(
                request, body, request_id, gen, meta.priority, endpoint, observer, key, span
            )
            status = response.status
            return response
        except asyncio.CancelledError:
            # Stargate hung up (aiohttp cancels the handler): the engine request is closed with it,
            # unless its answer was whole (``Delivered``). The span keeps the status Stargate got,
            # else a client's hang-up: no server error.
            started = observer is not None and observer.status is not None
            status = observer.status if observer is not None and observer.status is not None else 499
            if observer is not None and observer.delivered.done:
                observer.finish()
                raise
            report_client_gone(self.faults, request, request_id, started=started)
            if observer is not None:
                observer.cancel()
            raise
        finally:
            if observer is not None:
                observer.finish(failed=True)
            if span is not None:
                self._end_span(span, status, observer)

    def _end_span(self, span: Span, status: int, observer: RequestObserver | None) -> None:
        """Engine timing on Pylon's span: time to the engine's response headers and first output."""
        assert self.tracing is not None
        attributes: dict[str, AttributeValue] = {}
        if observer is not None:
            attributes["pylon.request.state"] = observer.state.value
            for name, value in (
                ("time_to_response_headers_ms", observer.ttrh),
                ("time_to_first_output_ms", observer.ttfo),
            ):
                if value is not None:
                    attributes[f"engine.{name}"] = round(value * 1000.0, 3)
            if observer.status is not None:
                attributes["engine.status_code"] = observer.status
        self.tracing.end(span, status, attributes)

    async def _admit(
        self,
        request: web.Request,
        body: bytes,
        request_id: str,
        gen: Generation,
        priority: int | None,
        endpoint: Endpoint | None,
        observer: RequestObserver | None,
        key: str | None,
        span: Span | None,
    ) -> web.StreamResponse:
        # Checked decoded, forwarded as received: a compressed body reaches the engine unchanged.
        coding = content_coding(request.headers)
        check = functools.partial(_body_rules, body, coding, endpoint, self.s.relay_non_streaming)
        error, items = await off_loop(check) if coding else check()
        if error is not None:
            return _problem(error)
        if endpoint is Endpoint.EMBEDDINGS and observer is not None:
            observer.embedding_items = items
        decision = admission.decide(
            self.admission,
            request.headers.get(h.EXPECTED_QUEUE_MS),
            load=self.load,
            gen=gen,
            request_id=request_id,
            priority=priority or 0,
            input_tps=self.hub.input_tps(gen),
            limit=self.hub.effective_limit(gen),
        )
        self._record_admission(gen.model_id, decision)
        if span is not None:
            span.set_attributes(_admission_attributes(decision))
        if decision.rejected:
            return self._reject(decision)
        if observer is not None:
            self.load.sent(request_id, self.hub.effective_limit(gen))
            self.hub.on_admitted(gen, key, observer.input_tokens)
        headers = upstream_headers(
            request.headers.items(),
            retry_header=self.s.upstream_retry_header,
            priority=priority,
            dynamo_ceiling=self._ceiling,
        )
        if observer is not None:
            # Pylon reads a tracked answer as it relays it (its events, its usage): uncompressed.
            headers["Accept-Encoding"] = "identity"
        if span is not None and self.tracing is not None:
            self.tracing.inject(span, headers)  # the engine continues this trace
        url = URL(self.s.upstream_base_url + request_target(request), encoded=True)  # forwarded as received
        return await self._relay(request, url, headers, body, observer)

    def _record_admission(self, model: str, decision: admission.Decision) -> None:
        self.metrics.admission_decided(self.s.inference_server_id, model, decision.result.value)
        if decision.expected_ms is not None:
            self.metrics.admission_expected.observe(decision.expected_ms)
        if decision.actual_ms is not None:
            self.metrics.admission_actual.observe(decision.actual_ms)

    def _reject(self, decision: admission.Decision) -> web.Response:
        self.metrics.retryable.labels(self.s.inference_server_id, QueueEstimateMismatch.code, "429").inc()
        return _problem(
            QueueEstimateMismatch(
                expected_ms=decision.expected_ms,
                actual_ms=decision.actual_ms,
                threshold_ms=decision.threshold_ms,
                retry_after_ms=self.admission.retry_after_ms,
            )
        )

    async def _forward_health(self, request: web.Request) -> web.StreamResponse:
        query = request_target(request).partition("?")[2]
        target = self.prober.probe_path + (f"?{query}" if query else "")
        url = URL(self.s.upstream_base_url + target, encoded=True)
        headers = upstream_headers(
            request.headers.items(),
            retry_header=self.s.upstream_retry_header,
            priority=None,
            dynamo_ceiling=None,
        )
        body = await request.read()
        return await self._relay(request, url, headers, body, None, health=True)

    async def _relay(
        self,
        request: web.Request,
        url: URL,
        headers: CIMultiDict[str],
        body: bytes,
        observer: RequestObserver | None,
        health: bool = False,
    ) -> web.StreamResponse:
        """``health``: a forwarded ``/health``, on Pylon's own connections (not queued behind
        relayed requests) and left out of the request counters (Stargate's probes of a dead engine
        counted as dozens of refusals a minute)."""
        refuse = _problem if health else self._local_failure
        session = self.control_session if health else self.session
        if self.s.upstream_authorization is not None:
            headers["Authorization"] = self.s.upstream_authorization  # the operator's, for the engine
        try:
            upstream = await session.request(
                request.method,
                url,
                headers=headers,
                data=body or None,
                timeout=self.timeout,
                allow_redirects=False,
            )
        except aiohttp.ConnectionTimeoutError:
            # Nothing reached the engine: safe to run elsewhere (unless configured off).
            return refuse(LocalConnectFailure(retryable=self.s.local_connect_failures_retryable))
        except TimeoutError:
            # Sent, then no answer in time: the engine may be running it, so never retryable.
            message = f"the engine sent no answer within {self.timeout.sock_read:g} s"
            return refuse(LocalConnectFailure(retryable=False, message=message))
        except aiohttp.ClientSSLError as exc:
            # The TLS handshake failed: nothing reached the engine, which is up (probing it in
            # plain text, as for a refusal, took half a second and called it alive).
            message = f"could not connect to the engine ({detail(failure_text(exc))})"
            return refuse(
                LocalConnectFailure(retryable=self.s.local_connect_failures_retryable, message=message)
            )
        except aiohttp.ClientConnectorError:
            # Refused, or the connection failed: nothing reached the engine.
            gone = await engine_gone(str(url), self.prober.probe_path)
            retryable = gone and self.s.local_connect_failures_retryable
            return refuse(LocalConnectFailure(retryable=retryable))
        except aiohttp.ClientConnectionError:
            # Sent, then the connection closed unanswered. An engine that refuses or drops a fresh
            # connection is gone and runs nothing (a request written on a connection it was closing
            # as it died); otherwise it may be running the request, so never retryable.
            gone = await engine_gone(str(url), self.prober.probe_path)
            retryable = gone and self.s.local_connect_failures_retryable
            message = "the engine closed the connection without answering"
            return refuse(LocalConnectFailure(retryable=retryable, message=message))
        except aiohttp.ClientResponseError:
            # The engine answered with a head that is not HTTP (a bad status line, oversized
            # headers): it read the request and may be running it, so never retryable.
            message = "the engine's answer is not HTTP"
            return refuse(LocalConnectFailure(retryable=False, message=message))
        async with upstream:
            out_headers, failure = response_headers(
                upstream.headers.items(), upstream.status, self.retry_policy
            )
            if not health:
                self._record_status(upstream.status, failure)
            if observer is not None:
                observer.headers(upstream.status)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=out_headers)
            request_id = observer.request_id if observer is not None else None
            try:
                await response.prepare(request)
            except ConnectionError:
                gone = report_client_gone(self.faults, request, request_id, started=False)
                if gone and observer is not None:
                    observer.cancel()
                return response
            sse = (
                observer is not None
                and observer.endpoint is not Endpoint.EMBEDDINGS
                and (upstream.headers.get("content-type", "").startswith("text/event-stream"))
            )
            kept: bytearray | None = None
            if sse and observer is not None:
                ok, tail = await self._pump_sse(upstream, response, observer)
            else:
                if observer is not None and observer.endpoint is not Endpoint.EMBEDDINGS:
                    kept = bytearray()  # a JSON answer: its usage counts the output tokens
                ok, tail = await self._pump(upstream, response, kept)
            if not ok:
                if observer is not None and observer.delivered.done:
                    observer.finish()  # the client left, or the engine broke, after the whole answer
                else:
                    # The client hung up (cancelled, as when it goes away earlier), or the engine broke.
                    gone = report_client_gone(self.faults, request, request_id, started=True)
                    if observer is not None:
                        if gone:
                            observer.cancel()
                        else:
                            observer.finish(failed=True)
                if tail:
                    with contextlib.suppress(ConnectionError):
                        await response.write(tail)
                if request.transport is not None:
                    request.transport.close()
                return response
            if observer is not None:
                if kept is not None and 200 <= upstream.status < 300:
                    observer.streamed = False
                    tokens, prompt, cached = json_usage(bytes(kept)) if kept else (None, None, None)
                    observer.reported_input_tokens, observer.reported_cached_tokens = prompt, cached
                    observer.output(1 if tokens is None else tokens, explicit=tokens is not None)
                elif not sse and observer.endpoint is Endpoint.EMBEDDINGS and 200 <= upstream.status < 300:
                    observer.output(0)
                observer.finish()
            # The slot is free before the client can see the end; the last piece and the end share a write.
            try:
                await response.write_eof(tail)
            except ConnectionError:
                if observer is None or not observer.delivered.done:
                    report_client_gone(self.faults, request, request_id, started=True)
            return response

    def _local_failure(self, failure: LocalConnectFailure) -> web.Response:
        """Pylon's own 503 for an engine that gave no answer, counted as the engine's refusals are:
        it was only a failed request, and an operator could not tell why."""
        if failure.retryable:
            self.metrics.retryable.labels(self.s.inference_server_id, failure.code, "503").inc()
        else:
            self.metrics.nonretryable.labels(self.s.inference_server_id, failure.code).inc()
        return _problem(failure)

    def _record_status(self, status: int, failure: str | None) -> None:
        if 200 <= status < 300:
            return
        if failure is None:
            self.metrics.retryable.labels(
                self.s.inference_server_id, "upstream_admission_rejected", str(status)
            ).inc()
        else:
            self.metrics.nonretryable.labels(self.s.inference_server_id, failure).inc()

    async def _pump(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, kept: bytearray | None = None
    ) -> tuple[bool, bytes]:
        """Relay the body except its last piece, which is returned for the caller to send with the end.

        ``kept`` collects a copy of the body up to ``MAX_OBSERVED_JSON`` bytes (cleared beyond it).
        """
        stall = _Stall(upstream, self.between_s)
        try:
            while chunk := await upstream.content.readany():
                stall.arrived()
                if kept is not None:
                    kept.extend(chunk)
                    if len(kept) > MAX_OBSERVED_JSON:
                        kept.clear()
                        kept = None
                if upstream.content.at_eof():
                    return True, chunk
                await response.write(chunk)
                stall.waiting()
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False, b""
        finally:
            stall.stop()
        return True, b""

    async def _pump_sse(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, observer: RequestObserver
    ) -> tuple[bool, bytes]:
        """As :meth:`_pump`, observing the stream; not ok when it ended before any event of an
        answer (``SseScanner.answered``: a Responses stream that ends in ``response.failed``
        without a token is relayed whole, and its observer records it failed)."""
        scanner = SseScanner(completions=observer.endpoint is Endpoint.COMPLETIONS)
        tail = b""
        stall = _Stall(upstream, self.between_s)
        try:
            while chunk := await upstream.content.readany():
                stall.arrived()
                explicit_before = scanner.explicit_tokens
                scanner.feed(chunk)
                if upstream.content.at_eof():
                    tail = chunk
                else:
                    await response.write(chunk)
                    observer.delivered.sent(chunk)
                if scanner.output_seen:
                    explicit = scanner.explicit_tokens
                    observer.output(scanner.tokens, explicit=explicit is not None)
                    if explicit is not None and explicit != explicit_before:
                        self.hub.on_usage(observer.request_id, observer.generation, explicit)
                        observer.reported_input_tokens = scanner.prompt_tokens
                        observer.reported_cached_tokens = scanner.cached_tokens
                stall.waiting()
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False, b""
        except EventTooLarge:
            # The spec's limit (pylon.md §10.1); without this line the client saw a stream cut for
            # no reason any log gave.
            log.warning(
                "request %s: stream cut: the engine sent an SSE event longer than %d bytes",
                detail(observer.request_id),
                MAX_PENDING_EVENT,
            )
            return False, b""
        finally:
            stall.stop()
        return scanner.answered, tail


def _admission_attributes(decision: admission.Decision) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"pylon.admission.result": decision.result.value}
    for name, value in (
        ("expected_ms", decision.expected_ms),
        ("actual_ms", decision.actual_ms),
        ("threshold_ms", decision.threshold_ms),
    ):
        if value is not None:
            attributes[f"pylon.queue.{name}"] = value
    return attributes


def _problem(exc: StargateError) -> web.Response:
    return error_response(exc, problem=True)


def _body_rules(
    body: bytes, coding: str | None, endpoint: Endpoint | None, relay_non_streaming: bool
) -> tuple[StargateError | None, int | None]:
    """What breaks the body rules (pylon.md §7.1), if anything, and an embeddings request's item
    count: only these are kept, not the decoded copy or the parsed body, while the request runs."""
    try:
        obj = json_body.loads(decoded(body, coding, MAX_BODY))
    except StargateError as exc:
        return exc, None
    except orjson.JSONDecodeError:
        return RequestError("request body must be valid JSON"), None
    if endpoint is Endpoint.EMBEDDINGS:
        return None, embedding_item_count(obj)
    streaming = isinstance(obj, dict) and obj.get("stream") is True
    if endpoint in (Endpoint.CHAT, Endpoint.RESPONSES) and not streaming and not relay_non_streaming:
        path = "/v1/chat/completions" if endpoint is Endpoint.CHAT else "/v1/responses"
        return RequestError(f"{path} requests must set stream=true", hint=_RELAY_HINT), None
    return None, None
