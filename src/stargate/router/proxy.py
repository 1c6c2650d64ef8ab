"""The HTTP proxy handler: parse headers, run attempts, stream the final answer (spec §4).

Bodies are opaque in both directions: the request body is streamed through the replay buffer, the
response is relayed chunk by chunk as it arrives (``iter_any``), with no parsing and no per-chunk
logging; its headers go out with its first body byte (until then a broken backend is retried,
``router/driver.py``), and the final chunk and the end of the body share one write. Every error
Stargate produces itself carries a short JSON body naming the problem.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from stargate.errors import RequestError, StargateError, UpstreamError
from stargate.responses import error_response
from stargate.router.driver import AttemptDriver, LocalFailure, Passthrough
from stargate.router.headers import (
    REQUEST_CONTRACT,
    REQUEST_DROPPED,
    RESPONSE_DROPPED,
    ProxyRequest,
    ResolveAlgorithm,
    filter_headers,
    parse_request,
    via_problem,
)
from stargate.router.metrics import RouterMetrics
from stargate.router.plain_client import PlainClients, new_request_id
from stargate.router.replay import ReplayBody
from stargate.tracing import RouteTrace
from stargate.wire import headers as h
from stargate.wire.body_budget import UNCAPPED, BodyBudget
from stargate.wire.client_faults import ClientFaults, detail
from stargate.wire.http_server import expectation_problem, report_client_gone, request_target, send_continue
from stargate.wire.limits import MAX_BODY_BYTES, MAX_BUFFERED_BODY_BYTES
from stargate.wire.sse import Delivered

if TYPE_CHECKING:
    from stargate.otel import Span, Tracing

log = logging.getLogger(__name__)


CLIENT_CLOSED = 499
"""The status counted for a request whose client hung up before its answer began (nginx's)."""


@dataclass(frozen=True, slots=True)
class ProxySettings:
    max_replay_body_bytes: int = MAX_BODY_BYTES
    max_buffered_body_bytes: int = MAX_BUFFERED_BODY_BYTES  # every request's together; 0 = no cap
    retry_budget_header: str | None = h.RETRY_BUDGET_MS
    default_max_wait_ms: int | None = None  # the routing wait of requests without x-max-wait-ms


class ProxyHandler:
    def __init__(
        self,
        driver: AttemptDriver,
        metrics: RouterMetrics,
        resolve: ResolveAlgorithm,
        settings: ProxySettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        plain: PlainClients | None = None,
        tracing: Tracing | None = None,
        client_faults: ClientFaults | None = None,
        budget: BodyBudget = UNCAPPED,
        via: str | None = None,
    ) -> None:
        """``via``: this router's ``Via`` name (``via_name``), added to every request it sends; a
        request that arrives with it is refused as a loop."""
        self._driver = driver
        self._via = via
        self._budget = budget
        self._faults = client_faults or ClientFaults(log)
        self._tracing = tracing
        self._plain = plain
        self._metrics = metrics
        self._resolve = resolve
        self._settings = settings
        self._clock = clock
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no proxied request is in flight; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue`` gets its 100 only past the checks the head allows (RFC 9110
        §10.1.1): told to go ahead, a client sent a body up to the limit only to see it refused."""
        problem = expectation_problem(request) or self._head_problem(request)
        if problem is None:
            try:
                if self._plain is not None and self._plain.incomplete(request.headers):
                    self._plain.check_declared(request)
                else:
                    self._parse(request.headers, self._clock())
            except StargateError as exc:
                problem = exc
        if problem is not None:
            return self._refused(request.headers, problem)  # a body sent all the same is read and dropped
        await send_continue(request)
        return None

    def _refused(self, headers: Mapping[str, str], problem: StargateError) -> web.Response:
        """A request refused before it was parsed still carries its ``x-request-id`` (every answer
        does): the client's, or in plain-client mode one made up; and it has its span."""
        response = error_response(problem)
        request_id = h.text_value(headers.get(h.REQUEST_ID))
        if request_id is None and self._plain is not None:
            request_id = new_request_id()
        if request_id is not None:
            response.headers[h.REQUEST_ID] = request_id
        if self._tracing is not None:
            attributes = {} if request_id is None else {"request.id": request_id}
            span = self._tracing.start("proxy_openai_request", headers, attributes)
            self._tracing.end(span, response.status, {})
        return response

    def _head_problem(self, request: web.Request) -> StargateError | None:
        if (too_many := h.too_many_fields(len(request.headers))) is not None:
            return RequestError(too_many)
        if self._via is not None:
            return via_problem(request.headers, self._via)
        return None

    def _parse(self, headers: Mapping[str, str], received_at: float) -> ProxyRequest:
        return parse_request(
            headers,
            resolve=self._resolve,
            retry_budget_header=self._settings.retry_budget_header,
            max_replay_body_bytes=self._settings.max_replay_body_bytes,
            received_at=received_at,
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        received_at = self._clock()
        if (problem := self._head_problem(request)) is not None:
            return self._refused(request.headers, problem)
        headers: Mapping[str, str] = request.headers
        replay: ReplayBody | None = None
        try:
            if self._plain is not None and self._plain.incomplete(headers):
                headers, body = await self._plain.complete(request)
                if body is not None:
                    replay = ReplayBody.read(body, self._budget)
            parsed = self._parse(headers, received_at)
        except StargateError as exc:
            if replay is not None:
                replay.release()
            return self._refused(headers, exc)
        if replay is None:
            source = request.content.iter_any() if request.body_exists else None
            replay = ReplayBody(source, self._settings.max_replay_body_bytes, self._budget)
        if parsed.max_wait_ms is None and self._settings.default_max_wait_ms is not None:
            parsed = dataclasses.replace(parsed, max_wait_ms=self._settings.default_max_wait_ms)
        self.in_flight += 1
        self._idle.clear()
        traced = self._begin_span(headers, parsed) if self._tracing is not None else None
        status = 500
        try:
            response = await self._proxy(request, parsed, headers, replay, traced)
            if not response.prepared:  # the router's own answer; a relayed one has it already
                response.headers.setdefault(h.REQUEST_ID, parsed.request_id)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            replay.release()
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
            if traced is not None:
                self._end_span(parsed, traced[1].relayed_status or status, *traced)

    def _begin_span(self, headers: Mapping[str, str], parsed: ProxyRequest) -> tuple[Span, RouteTrace]:
        assert self._tracing is not None
        attributes = {"request.id": parsed.request_id, "model": parsed.target.model_id}
        if parsed.target.routing_key is not None:
            attributes["routing.key"] = parsed.target.routing_key
        return self._tracing.start("proxy_openai_request", headers, attributes), RouteTrace()

    def _end_span(self, parsed: ProxyRequest, status: int, span: Span, route: RouteTrace) -> None:
        """The routing decision on the request's span (names after the original's span fields)."""
        assert self._tracing is not None
        self._tracing.end(
            span,
            status,
            {
                "routing.algorithm": parsed.definition.algorithm.value,
                "routing.rank_depth": route.rank_depth,
                "routing.wait_ms": round(route.waited_s * 1000.0, 3),
                "routing.retry_attempts": max(0, route.attempts - 1),
                "proxy.attempt": route.attempts,
                "proxy.retry_reason": route.retry_reasons,
                "selected_inst.id": route.backend_id,
                "selected_cluster.id": route.cluster_id,
            },
        )

    async def _proxy(
        self,
        request: web.Request,
        parsed: ProxyRequest,
        headers: Mapping[str, str],
        replay: ReplayBody,
        traced: tuple[Span, RouteTrace] | None,
    ) -> web.StreamResponse:
        forwarded = filter_headers(headers.items(), REQUEST_DROPPED)
        for name in REQUEST_CONTRACT:
            if name not in forwarded:  # named in Connection: this hop's, but the next one's too
                forwarded[name] = headers[name]
        if self._via is not None:
            forwarded[h.VIA] = ", ".join([*forwarded.popall(h.VIA, ()), f"1.1 {self._via}"])
        route = RouteTrace()
        if traced is not None:
            assert self._tracing is not None
            self._tracing.inject(traced[0], forwarded)
            route = traced[1]
        try:
            try:
                await replay.read_ahead()
            except (HttpProcessingError, RequestPayloadError) as exc:
                self._metrics.request_finished(parsed.target, "", 400)
                return error_response(RequestError(f"the request body could not be read: {detail(exc)}"))
            outcome = await self._driver.run(
                parsed, request.method, request_target(request), forwarded, replay, route
            )
            replay.release()  # no attempt follows: the answer may stream for minutes without it
        except asyncio.CancelledError:
            # The client hung up (aiohttp cancels its handler): the attempt is cancelled upstream.
            self._metrics.request_finished(parsed.target, route.at_backend, CLIENT_CLOSED)
            report_client_gone(self._faults, request, parsed.request_id, started=False)
            raise
        except Exception:
            log.exception(
                "request %s for model %s failed inside the proxy",
                parsed.request_id,
                parsed.target.model_id,
            )
            self._metrics.request_finished(parsed.target, "", 500)
            return error_response(StargateError("internal proxy error"))
        if isinstance(outcome, LocalFailure):
            self._metrics.request_finished(parsed.target, outcome.backend_id, outcome.error.status)
            report_client_gone(self._faults, request, parsed.request_id, started=False)
            return error_response(outcome.error)
        return await self._relay(request, outcome, parsed, route)

    async def _relay(
        self, request: web.Request, outcome: Passthrough, parsed: ProxyRequest, route: RouteTrace
    ) -> web.StreamResponse:
        target = parsed.target
        upstream, backend = outcome.response, outcome.backend
        if not (
            h.valid_header_value(backend.inference_server_id)
            and h.valid_header_value(backend.url)
            and h.valid_header_value(backend.cluster_id)
        ):
            upstream.release()
            self._driver.finish(outcome)
            self._metrics.request_finished(target, backend.inference_server_id, 500)
            return error_response(StargateError("backend identity cannot be sent as a header value"))
        route.relayed_status = upstream.status
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(filter_headers(upstream.headers, RESPONSE_DROPPED))
        response.headers[h.INFERENCE_SERVER_ID] = backend.inference_server_id
        response.headers[h.INFERENCE_SERVER_URL] = backend.url
        response.headers[h.CLUSTER_ID] = backend.cluster_id
        # The id a client can quote in a report: in plain-client mode the router made it up.
        response.headers.setdefault(h.REQUEST_ID, parsed.request_id)
        started = cut = False
        delivered = Delivered()
        try:
            await response.prepare(request)
            started = True
            chunk = outcome.first
            while chunk is not None:
                if upstream.complete():
                    # The last piece goes out with the end of the body (and the headers, if still
                    # buffered) in one write: at low concurrency that is a send() saved per request.
                    await response.write_eof(chunk)
                    break
                await response.write(chunk)
                delivered.sent(chunk)
                chunk = await anext(outcome.rest, None)
            await response.write_eof()  # no-op once sent
        except UpstreamError as exc:
            # Headers are gone already: the only honest signal left is an aborted connection.
            log.warning(
                "upstream %s broke mid-response to request %s for model %s: %s",
                backend.inference_server_id,
                parsed.request_id,
                target.model_id,
                exc,
            )
            if request.transport is not None:
                request.transport.abort()
            cut = True
            self._metrics.response_cut(target, backend.inference_server_id, "backend")
        except ConnectionError:
            # The client went away; nothing left to tell it (and nothing missed after [DONE]).
            if not delivered.done:
                self._client_gone(request, parsed, backend.inference_server_id, started)
        except asyncio.CancelledError:
            if not delivered.done:
                self._client_gone(request, parsed, backend.inference_server_id, started)
            raise
        finally:
            upstream.release()
            self._driver.finish(outcome, cut)
            self._metrics.request_finished(target, backend.inference_server_id, upstream.status)
        return response

    def _client_gone(
        self, request: web.Request, parsed: ProxyRequest, backend_id: str, started: bool
    ) -> None:
        if report_client_gone(self._faults, request, parsed.request_id, started=started) and started:
            self._metrics.response_cut(parsed.target, backend_id, "client")
