"""Composition of the router service: routing state, control plane, HTTP proxy and metrics server.

``StargateServer.start`` binds every listener (port 0 → ephemeral) and returns the bound addresses;
``shutdown`` drains (``/readyz`` answers 503, in-flight proxied requests may finish within the drain
timeout; requests still held waiting for room then get a 503) and then stops the listeners and
closes the one client session of the process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from stargate.balancer import check_admission, expected_queue_ms
from stargate.balancer.config import LbConfig
from stargate.errors import ConfigError
from stargate.responses import json_route_errors
from stargate.router.attempt import AttemptMachine, RetrySettings
from stargate.router.control_plane import ControlPlane, ControlPlaneSettings
from stargate.router.discovery import DiscoverySettings
from stargate.router.driver import AttemptDriver
from stargate.router.endpoints import Endpoints
from stargate.router.headers import via_name
from stargate.router.health import HealthSettings
from stargate.router.metrics import DEFAULT_PREFIX, RouterMetrics
from stargate.router.plain_client import PlainClients, PlainClientSettings, new_request_id
from stargate.router.proxy import ProxyHandler, ProxySettings
from stargate.router.state import RoutingState
from stargate.router.transport import DEFAULT_LIMIT_PER_HOST, HttpTransport, make_session
from stargate.tracing import setup_tracing
from stargate.wire import address
from stargate.wire import headers as h
from stargate.wire.address import join_host_port
from stargate.wire.body_budget import BodyBudget
from stargate.wire.client_faults import ClientFaults
from stargate.wire.clock import Clock, SystemClock
from stargate.wire.http_server import ClientTimeouts, GuardedAppRunner
from stargate.wire.listen import listen

if TYPE_CHECKING:
    from stargate.otel import Tracing

log = logging.getLogger(__name__)

PROXIED_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/embeddings")
PLAIN_CLIENT_PATHS = ("/v1/completions",)  # proxied only in plain-client mode (docs/compat.md)
RELEASE_HELD_S = 1.0  # held requests poll at least every 25 ms: they end well within this


@dataclass(frozen=True)
class StargateSettings:
    stargate_id: str
    advertise_addr: str
    listen_addr: str = "0.0.0.0:50071"
    model_discovery_listen_addr: str = "0.0.0.0:50073"
    http_listen_addr: str = "0.0.0.0:8000"
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9090
    metrics_prefix: str = DEFAULT_PREFIX
    shutdown_drain_timeout_ms: int = 30_000
    http_header_read_timeout_ms: int = 10_000  # 0 = no request-head deadline
    http_body_read_timeout_ms: int = 60_000  # 0 = a request body may pause for ever
    http_send_timeout_ms: int = 60_000  # 0 = a client may leave its answer unread for ever
    lb_config: LbConfig = field(default_factory=LbConfig.permissive)
    retry: RetrySettings = field(default_factory=RetrySettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    connect_timeout_ms: int = 2_000
    request_timeout_ms: int = 30_000
    backend_connection_limit: int = DEFAULT_LIMIT_PER_HOST
    stargate_discovery_dns_name: str | None = None
    disable_dns_discovery: bool = False
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    otel_endpoint: str | None = None
    otel_service_name: str = "stargate"
    """Peer lookup; its ``dns_name`` is set only when discovery is enabled."""
    grpc_pylon_dial_addr: str | None = None
    remote_stargate_urls: tuple[str, ...] = ()
    watch_heartbeat_ms: int = 5_000
    registration_idle_timeout_ms: int = 60_000
    registration_max_idle_timeout_ms: int = 300_000
    health: HealthSettings = field(default_factory=HealthSettings)
    tunnel_protocol: str = "raw-quic"
    direct_quic_connections: int = 1
    plain_clients: PlainClientSettings | None = None  # None = the spec's header contract only


@dataclass(frozen=True)
class BoundAddresses:
    grpc: str
    model_discovery: str
    http: str
    metrics: str

    def ready_line(self) -> str:
        return (
            f"stargate ready grpc={self.grpc} discovery={self.model_discovery} "
            f"http={self.http} metrics={self.metrics}"
        )


def split_host_port(addr: str, flag: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; a malformed address is a ``ConfigError`` naming the flag."""
    try:
        return address.split_host_port(addr)
    except ValueError as exc:
        raise ConfigError(str(exc), path=flag) from None


class StargateServer:
    def __init__(
        self,
        settings: StargateSettings,
        *,
        metrics: RouterMetrics | None = None,
        tracing: Tracing | None = None,
        client_faults: ClientFaults | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``tracing`` overrides the exporter that ``settings.otel_endpoint`` would set up; ``clock``
        is the one time source of routing state, attempts, the proxy and the control plane."""
        self.settings = settings
        self.clock = clock or SystemClock()
        self.tracing = tracing
        self.client_faults = client_faults or ClientFaults(logging.getLogger("stargate.router.clients"))
        self.metrics = metrics or RouterMetrics(settings.metrics_prefix, clock=self.clock.monotonic)
        self.state = RoutingState(
            clock=self.clock.monotonic,
            wall_clock=self.clock.wall,
            on_active_count=self.metrics.set_active,
            on_backend_live=self.metrics.backend_live,
        )
        self.via = via_name()
        """This router's name in ``Via``: requests and probes that come back to it are refused."""
        self.endpoints = Endpoints(
            self.state.list_models,
            self.state.active_model_ids,
            self._debug_config,
            self.state.describe,
            openai=settings.plain_clients is not None,
            via=self.via,
        )
        self.addresses: BoundAddresses | None = None
        self.control_plane: ControlPlane | None = None
        self.proxy: ProxyHandler | None = None
        self.body_budget: BodyBudget | None = None
        self._driver: AttemptDriver | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []

    async def start(self) -> BoundAddresses:
        s = self.settings
        http_host, http_port = split_host_port(s.http_listen_addr, "--http-listen-addr")
        grpc_host, _ = split_host_port(s.listen_addr, "--listen-addr")
        discovery_host, _ = split_host_port(s.model_discovery_listen_addr, "--model-discovery-listen-addr")
        advertise_host, _ = split_host_port(s.advertise_addr, "--advertise-addr")
        # A body waits for room in the budget as long as it may pause while sent (0: for ever).
        self.body_budget = budget = BodyBudget(
            s.proxy.max_buffered_body_bytes, s.http_body_read_timeout_ms / 1000.0 or None
        )
        self.metrics.watch_body_budget(budget)
        plain = (  # may load a tokenizer
            PlainClients(s.plain_clients, budget=budget) if s.plain_clients is not None else None
        )
        if self.tracing is None:
            self.tracing = setup_tracing(s.otel_endpoint, s.otel_service_name)
        self._session = make_session(s.connect_timeout_ms / 1000.0, s.backend_connection_limit)
        transport = HttpTransport(
            self._session,
            connect_timeout_s=s.connect_timeout_ms / 1000.0,
            request_timeout_s=s.request_timeout_ms / 1000.0,
            alive=self.state.is_routable,
        )
        machine = AttemptMachine(s.retry, admission=check_admission, expected_queue=expected_queue_ms)
        self._driver = driver = AttemptDriver(
            self.state, machine, transport, self.metrics, clock=self.clock.monotonic, sleep=self.clock.sleep
        )
        self.proxy = proxy = ProxyHandler(
            driver,
            self.metrics,
            s.lb_config.resolve_algorithm,
            s.proxy,
            clock=self.clock.monotonic,
            plain=plain,
            tracing=self.tracing,
            client_faults=self.client_faults,
            budget=budget,
            via=self.via,
        )
        try:
            http_bound = await self._serve(self._http_app(proxy), http_host, http_port, "--http-listen-addr")
            metrics_bound = await self._serve(
                self._metrics_app(), s.metrics_host, s.metrics_port, "--metrics-host/--metrics-port"
            )
            # Health probes get connections of their own: queued behind a full pool of requests,
            # they failed and took a backend serving them all out of routing.
            self._probe_session = make_session(s.connect_timeout_ms / 1000.0, 0)
            self.control_plane = ControlPlane(
                self.state,
                self._control_plane_settings(advertise_host, http_bound[1]),
                self._probe_session,
                clock=self.clock,
            )
            grpc_port, discovery_port = await self.control_plane.start(
                s.listen_addr, s.model_discovery_listen_addr
            )
        except BaseException:
            await self._close()
            raise
        self.addresses = BoundAddresses(
            grpc=join_host_port(grpc_host, grpc_port),
            model_discovery=join_host_port(discovery_host, discovery_port),
            http=join_host_port(http_host, http_bound[1]),
            metrics=join_host_port(s.metrics_host, metrics_bound[1]),
        )
        return self.addresses

    def begin_drain(self) -> None:
        self.endpoints.draining = True

    async def shutdown(self, drain_timeout_s: float | None = None) -> bool:
        """Drain, then stop everything; False when in-flight requests outlived the drain timeout."""
        self.begin_drain()
        timeout = (
            self.settings.shutdown_drain_timeout_ms / 1000.0 if drain_timeout_s is None else drain_timeout_s
        )
        drained = await self.proxy.wait_idle(timeout) if self.proxy is not None else True
        if not drained:
            log.warning("shutdown drain timeout of %.3f s exceeded with requests in flight", timeout)
            if self._driver is not None:
                # Held requests were never sent: a 503 lets their clients retry elsewhere, where a
                # cut connection says nothing (and with the control plane gone they would see 404).
                await self._driver.release_held(RELEASE_HELD_S)
        await self._close()
        return drained

    async def _close(self) -> None:
        # Listeners first: with the control plane gone first, a request arriving meanwhile found no
        # registration and was answered 404 (the model is not served), which clients do not retry.
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.control_plane is not None:
            await self.control_plane.stop(grace_s=0.5)
            self.control_plane = None
        for session in (self._session, self._probe_session):
            if session is not None:
                await session.close()
        self._session = self._probe_session = None
        if self.tracing is not None:
            self.tracing.shutdown()

    async def _serve(self, app: web.Application, host: str, port: int, flag: str) -> tuple[str, int]:
        # Request bodies are forwarded as received, Content-Encoding included: never decompressed here.
        runner = GuardedAppRunner(
            app,
            faults=self.client_faults,
            timeouts=ClientTimeouts(
                self.settings.http_header_read_timeout_ms / 1000.0,
                self.settings.http_body_read_timeout_ms / 1000.0,
                self.settings.http_send_timeout_ms / 1000.0,
            ),
            access_log=None,
            shutdown_timeout=1.0,
            auto_decompress=False,
        )
        try:
            bound = await listen(runner, host, port)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {join_host_port(host, port)}: {exc.strerror or exc}", path=flag
            ) from exc
        self._runners.append(runner)
        return host, bound

    def _http_app(self, proxy: ProxyHandler) -> web.Application:
        app = web.Application(middlewares=[json_route_errors])
        paths = PROXIED_PATHS + (PLAIN_CLIENT_PATHS if self.settings.plain_clients is not None else ())
        for path in paths:
            app.router.add_post(path, proxy.handle, expect_handler=proxy.expect)
        self.endpoints.add_routes(app)
        app.on_response_prepare.append(self._close_while_draining)
        app.on_response_prepare.append(self._stamp_request_id)
        return app

    async def _stamp_request_id(self, request: web.Request, response: web.StreamResponse) -> None:
        """An error answered outside the proxy (an unknown path or method) carries the request's
        ``x-request-id`` too, as every proxied answer does: the client's, or in plain-client mode
        one made up, so a client's log line can be matched to Stargate's."""
        if response.status < 400 or h.REQUEST_ID in response.headers:
            return
        request_id = h.text_value(request.headers.get(h.REQUEST_ID))
        if request_id is None and self.settings.plain_clients is not None:
            request_id = new_request_id()
        if request_id is not None:
            response.headers[h.REQUEST_ID] = request_id

    async def _close_while_draining(self, _request: web.Request, response: web.StreamResponse) -> None:
        """A draining router closes each connection after its answer (``Connection: close``): a
        client or gateway that keeps connections open opens its next one where it is routed now,
        another replica once the load balancer has read ``/readyz``."""
        if self.endpoints.draining:
            response.force_close()
            response.headers["Connection"] = "close"  # the head is built before this hook runs

    def _metrics_app(self) -> web.Application:
        async def render(request: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application(middlewares=[json_route_errors])
        app.router.add_get("/metrics", render)
        return app

    def _control_plane_settings(self, advertise_host: str, http_port: int) -> ControlPlaneSettings:
        s = self.settings
        return ControlPlaneSettings(
            stargate_id=s.stargate_id,
            advertise_addr=s.advertise_addr,
            http_advertise_addr=join_host_port(advertise_host, http_port),
            grpc_pylon_dial_addr=s.grpc_pylon_dial_addr,
            remote_stargate_urls=s.remote_stargate_urls,
            discovery_dns_name=None if s.disable_dns_discovery else s.stargate_discovery_dns_name,
            discovery=s.discovery,
            watch_heartbeat_ms=s.watch_heartbeat_ms,
            idle_timeout_floor_ms=s.registration_idle_timeout_ms,
            idle_timeout_cap_ms=s.registration_max_idle_timeout_ms,
            health=s.health,
            via=self.via,
        )

    def _debug_config(self) -> Mapping[str, object]:
        s, bound = self.settings, self.addresses
        return {
            "stargate_id": s.stargate_id,
            "grpc_listen_addr": bound.grpc if bound else s.listen_addr,
            "model_discovery_listen_addr": bound.model_discovery if bound else s.model_discovery_listen_addr,
            "http_listen_addr": bound.http if bound else s.http_listen_addr,
            "metrics_listen_addr": bound.metrics if bound else join_host_port(s.metrics_host, s.metrics_port),
            "advertise_addr": self.control_plane.advertise_addr if self.control_plane else s.advertise_addr,
            "stargate_discovery_dns_name": s.stargate_discovery_dns_name,
            "tunnel_protocol": s.tunnel_protocol,
            "backend_connectivity": "direct",
            "direct_quic_connections": s.direct_quic_connections,
        }
