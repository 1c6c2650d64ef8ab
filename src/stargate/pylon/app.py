"""Composition of one Pylon process (spec pylon.md §3).

Order: metrics listener → stats tasks → HTTP listener (requests for not-yet-admitted models get
503) → blocking model lifecycle start → registration → background tasks. ``run`` returns when
stopped (0) or when a critical task ends (1).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import IO, TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from stargate.errors import ConfigError
from stargate.proto import stargate_pb2
from stargate.pylon.calibration import Calibrator
from stargate.pylon.canary import CanaryRunner
from stargate.pylon.config import PylonSettings, StatsSource, StatsStreamMode
from stargate.pylon.health import HealthProber
from stargate.pylon.ids import RequestIds
from stargate.pylon.live_metrics import LiveLoadCollector
from stargate.pylon.load import LiveLoad
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.models import ModelRegistry
from stargate.pylon.registration import RegistrationClient, StargateDiscovery, stats_to_proto, token_source
from stargate.pylon.relay import Relay, RelayTimeouts
from stargate.pylon.startup import ModelLifecycle
from stargate.pylon.stats.engine_stream import EngineStatsStream
from stargate.pylon.stats.hub import StatsHub
from stargate.pylon.stats.kv import run_kv_poller
from stargate.pylon.stats.prometheus import run_prometheus_poller
from stargate.responses import json_route_errors
from stargate.tracing import setup_tracing
from stargate.wire.address import join_host_port
from stargate.wire.client_faults import ClientFaults
from stargate.wire.clock import Clock, SystemClock
from stargate.wire.http_client import client_session
from stargate.wire.http_server import ClientTimeouts, GuardedAppRunner
from stargate.wire.listen import listen

if TYPE_CHECKING:
    from stargate.otel import Tracing

log = logging.getLogger("stargate.pylon")
SWEEP_INTERVAL_S = 1.0
SHUTDOWN_TIMEOUT_S = 5.0


class PylonApp:
    def __init__(
        self,
        settings: PylonSettings,
        *,
        clock: Clock | None = None,
        out: IO[str] | None = None,
        relay_timeouts: RelayTimeouts | None = None,
        tracing: Tracing | None = None,
        client_faults: ClientFaults | None = None,
    ) -> None:
        """``tracing`` overrides the exporter that ``settings.otel_endpoint`` would set up."""
        self.s = settings
        self.client_faults = client_faults or ClientFaults(logging.getLogger("stargate.pylon.clients"))
        self.tracing = tracing
        self.clock = clock or SystemClock()
        self._out = out
        self._relay_timeouts = relay_timeouts or RelayTimeouts()
        self.metrics = PylonMetrics(clock=self.clock.monotonic)
        self.registry = ModelRegistry()
        self.relay: Relay | None = None
        self.load = LiveLoad(prefix_caching=settings.engine_prefix_caching, clock=self.clock.monotonic)
        self.ids = RequestIds()
        self.hub = StatsHub(
            registry=self.registry,
            load=self.load,
            clock=self.clock,
            ids=self.ids,
            metrics=self.metrics,
            initial_input_tps=settings.initial_input_tps,
            pin_input_tps=settings.pin_input_tps,
            max_engine_concurrency=settings.max_engine_concurrency,
            fallback_enabled=settings.fallback_stats_at_start,
            # Every stream sends at least once a period: each route reaches every router.
            route_window_ms=2 * settings.min_update_interval_ms,
        )
        self.metrics.add_collector(
            LiveLoadCollector(
                self.load, self.hub.counter_entries, self.hub.model_states, lambda: self.hub.counter_source
            )
        )
        self._advertised: dict[str, str] = {}
        self._routers_up: set[str] = set()
        self.http_url = ""
        self.metrics_port = 0
        self._session: aiohttp.ClientSession | None = None
        self._relay_session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        self._critical: dict[asyncio.Task[Any], str] = {}
        self._optional: list[asyncio.Task[Any]] = []
        self._lifecycle: ModelLifecycle | None = None
        self.canaries: CanaryRunner | None = None
        self.registration: RegistrationClient | None = None

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str, *, critical: bool = True) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        if critical:
            self._critical[task] = name
        else:
            self._optional.append(task)

    async def _serve(self, app: web.Application, host: str, port: int, flag: str) -> int:
        # Bodies pass through as received: no decompression of request bodies (bytes in, bytes out).
        runner = GuardedAppRunner(
            app,
            faults=self.client_faults,
            timeouts=ClientTimeouts(
                self.s.http_header_read_timeout_ms / 1000.0,
                self.s.http_body_read_timeout_ms / 1000.0,
                self.s.http_send_timeout_ms / 1000.0,
            ),
            problem=True,
            access_log=None,
            handle_signals=False,
            auto_decompress=False,
        )
        try:
            bound = await listen(runner, host, port)
        except OSError as exc:
            await runner.cleanup()
            reason = f"cannot listen on {join_host_port(host, port)}: {exc.strerror or exc}"
            raise ConfigError(reason, path=flag) from exc
        self._runners.append(runner)
        return bound

    async def _metrics_handler(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    def registration_message(self) -> stargate_pb2.InferenceServerRegistration:
        msg = stargate_pb2.InferenceServerRegistration(
            inference_server_id=self.s.inference_server_id,
            inference_server_url=self.http_url,
            reverse_tunnel=False,
            cluster_id=self.s.cluster_id,
        )
        advertised: dict[str, str] = {}
        for gen, status in self.registry.published():
            advertised[gen.model_id] = status.name.lower()
            stats = self.hub.snapshot(gen)
            self.metrics.publish_model(gen.model_id, stats)
            self.metrics.publish_embedding_items(gen.model_id, *self.hub.embedding_item_tps(gen))
            msg.models[gen.model_id].CopyFrom(
                stargate_pb2.InferenceServerModelRegistration(stats=stats_to_proto(stats), status=int(status))  # type: ignore[arg-type]
            )
        self._advertised = advertised
        for router in self._routers_up:
            self.metrics.advertise(router, advertised)
        return msg

    def _on_router(self, router: str, up: bool) -> None:
        """Registration stream acknowledged (``up``) or lost: connection and advertised-status gauges."""
        self.metrics.registration_connected.labels(router).set(int(up))
        if up:
            self._routers_up.add(router)
            self.metrics.advertise(router, self._advertised)
        else:
            self._routers_up.discard(router)
            self.metrics.router_lost(router)
        self.metrics.registered_stargates.set(len(self._routers_up))
        if self.registration is not None:
            self.metrics.router_discovered(router, router in self.registration.routers)

    async def start(self) -> None:
        s = self.s
        if self.tracing is None:
            self.tracing = setup_tracing(s.otel_endpoint, s.otel_service_name)
        metrics_app = web.Application(middlewares=[json_route_errors])
        metrics_app.router.add_get("/metrics", self._metrics_handler)
        self.metrics_port = await self._serve(metrics_app, s.metrics_host, s.metrics_port, "--metrics-port")
        engine_auth = {"Authorization": s.upstream_authorization} if s.upstream_authorization else None
        # Relayed requests get a pool of their own: Pylon's /health, probes and canaries queued behind
        # 4096 relayed streams and Stargate took a healthy, busy backend out of routing.
        keepalive_s = s.engine_keepalive_ms / 1000.0
        self._session = session = client_session(
            connect_timeout_s=10.0, headers=engine_auth, keepalive_s=keepalive_s
        )
        self._relay_session = client_session(
            connect_timeout_s=10.0,
            limit=s.max_engine_connections,
            headers=engine_auth,
            keepalive_s=keepalive_s,
        )
        stream: EngineStatsStream | None = None
        if s.stats_source is StatsSource.PROMETHEUS:
            self._spawn(
                run_prometheus_poller(
                    session,
                    s.engine_metrics_url,
                    self.hub,
                    interval_s=s.engine_metrics_interval_ms / 1000.0,
                    sleep=self.clock.sleep,
                ),
                "engine-metrics",
            )
        elif s.stats_stream_mode is not StatsStreamMode.OFF:
            stream = EngineStatsStream(
                session=session,
                url=s.stats_stream_url,
                mode=s.stats_stream_mode,
                hub=self.hub,
                metrics=self.metrics,
                sleep=self.clock.sleep,
            )
            self._spawn(
                stream.run(), "engine-stats-stream", critical=s.stats_stream_mode is StatsStreamMode.REQUIRED
            )
        if s.kv_cache_stats_url:
            kv = run_kv_poller(session, s.kv_cache_stats_url, self.hub, sleep=self.clock.sleep)
            self._spawn(kv, "kv-poller")
        self._spawn(self._sweep(), "stats-collector")
        prober = HealthProber(session, s.upstream_base_url, s.health_paths, clock=self.clock)
        self.relay = relay = Relay(
            settings=s,
            session=self._relay_session,
            control_session=session,
            registry=self.registry,
            hub=self.hub,
            load=self.load,
            metrics=self.metrics,
            clock=self.clock,
            prober=prober,
            timeouts=self._relay_timeouts,
            tracing=self.tracing,
            client_faults=self.client_faults,
        )
        port = await self._serve(relay.app(), s.http_listen_host, s.http_listen_port, "--http-listen-addr")
        self.http_url = "http://" + (s.http_advertise_addr or join_host_port(s.http_listen_host, port))
        calibrator = None
        if s.do_calibration:
            log.warning("calibration is only valid when this is the only Pylon of cluster %s", s.cluster_id)
            calibrator = Calibrator(
                session=session,
                base_url=s.upstream_base_url,
                hub=self.hub,
                ids=self.ids,
                clock=self.clock,
                requests=s.calibration_requests,
                prompt_units=s.calibration_prompt_units,
                max_concurrency=s.calibration_max_concurrency,
                step_timeout_s=s.calibration_step_timeout_ms / 1000.0,
            )
        if not s.disable_bringup and s.canary_interval_ms > 0:
            self.canaries = CanaryRunner(
                session=session,
                base_url=s.upstream_base_url,
                ids=self.ids,
                registry=self.registry,
                prober=prober,
                interval_s=s.canary_interval_ms / 1000.0,
                threshold=s.canary_max_generation_threshold,
                timeout_s=s.bringup_timeout_ms / 1000.0,
                clock=self.clock,
                produced=relay.produced_within,
                work_ahead=relay.work_ahead_s,
                waiting=self.load.oldest_wait_s,
                occupying=self.load.occupying,
            )
        canaries = self.canaries
        self._lifecycle = ModelLifecycle(
            settings=s,
            session=session,
            registry=self.registry,
            hub=self.hub,
            prober=prober,
            calibrator=calibrator,
            metrics=self.metrics,
            on_admitted=canaries.start if canaries is not None else lambda _gen: None,
            on_retired=canaries.stop if canaries is not None else lambda _gen: None,
            clock=self.clock,
        )
        await self._lifecycle.start()
        if stream is not None:
            stream.wake()  # the engine answers now: its stream too, most likely
        self.registration = RegistrationClient(
            snapshot=self.registration_message,
            interval_ms=s.min_update_interval_ms,
            token=token_source(s.auth_token, s.auth_token_file),
            on_connected=self._on_router,
            coalesce_ms=s.stats_update_coalesce_ms,
            clock=self.clock,
        )
        self.hub.on_change = self.registration.notify
        routers = self.registration.update_routers
        discovery = StargateDiscovery(list(s.stargate_addresses), routers, clock=self.clock)
        self._spawn(discovery.run(), "stargate-discovery")
        if s.discovery_mode:
            self._spawn(self._lifecycle.run_discovery(), "model-discovery")
        if self._out is not None:
            self._out.write(
                f"pylon ready http={self.http_url.removeprefix('http://')} metrics={self.metrics_port}\n"
            )
            self._out.flush()

    async def _sweep(self) -> None:
        while True:
            await self.clock.sleep(SWEEP_INTERVAL_S)
            self.hub.sweep()

    async def run(self, stop: asyncio.Event) -> int:
        """Wait for ``stop`` (exit 0) or for any critical task to end (exit 1)."""
        stopper = asyncio.get_running_loop().create_task(stop.wait())
        done, _ = await asyncio.wait([stopper, *self._critical], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if stopper in done:
            return 0
        for task in done:
            name = self._critical.get(task, "task")
            exc = task.exception() if not task.cancelled() else None
            log.error("critical task %s ended%s", name, f": {exc!r}" if exc else "")
        return 1

    async def close(self) -> None:
        tasks = [*self._critical, *self._optional]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
        if self.registration is not None:
            await self.registration.close()
        if self._lifecycle is not None:
            await self._lifecycle.close()
        if self.canaries is not None:
            await self.canaries.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self.tracing is not None:
            self.tracing.shutdown()
        for session in (self._relay_session, self._session):
            if session is not None:
                await session.close()
