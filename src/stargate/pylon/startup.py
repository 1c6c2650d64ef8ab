"""Model lifecycle: health-gated start, model discovery and per-generation initialization
(spec pylon.md §3 step 8, §4, §5).

Startup is sequential and blocking: health wait (when probing), initial model set (static or
one discovery poll), then per model in name order: allocate a pending generation, initialise
its stats from exactly one source, probe and calibrate, publish. Any failure aborts startup
before a single Stargate RPC is made.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import orjson

from stargate.errors import CalibrationError, DiscoveryError, StargateError, StartupError
from stargate.pylon.calibration import Calibrator
from stargate.pylon.config import PylonSettings
from stargate.pylon.health import HealthProber
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.models import Generation, ModelRegistry
from stargate.pylon.stats.hub import StatsHub
from stargate.wire.client_faults import detail
from stargate.wire.clock import Clock, SystemClock
from stargate.wire.headers import model_id_problem

log = logging.getLogger("stargate.pylon.startup")
PROVIDER = "dynamo"
STATIC_RETRY_S = 1.0




async def poll_models(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float
) -> tuple[list[str], set[str]]:
    """``GET /v1/models`` → sorted unique ids, and the ids left out because no request could name
    them (Stargate refuses a registration listing one); any blank id invalidates the whole poll."""
    try:
        async with session.get(
            base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            body = await resp.read()
            if not 200 <= resp.status < 300:
                raise DiscoveryError(f"/v1/models answered HTTP {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise DiscoveryError(f"/v1/models failed: {exc}") from exc
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise DiscoveryError("/v1/models body is not JSON") from exc
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        raise DiscoveryError("/v1/models body has no data array")
    ids: set[str] = set()
    unnamable: set[str] = set()
    for item in data:
        raw = item.get("id") if isinstance(item, dict) else None
        if not isinstance(raw, str) or not raw.strip():
            raise DiscoveryError("/v1/models lists a blank or missing id")
        (ids if model_id_problem(raw.strip()) is None else unnamable).add(raw.strip())
    return sorted(ids), unnamable


class ModelLifecycle:
    def __init__(
        self,
        *,
        settings: PylonSettings,
        session: aiohttp.ClientSession,
        registry: ModelRegistry,
        hub: StatsHub,
        prober: HealthProber,
        calibrator: Calibrator | None,
        metrics: PylonMetrics,
        on_admitted: Callable[[Generation], None] = lambda _gen: None,
        on_retired: Callable[[Generation], None] = lambda _gen: None,
        clock: Clock | None = None,
    ) -> None:
        self.s = settings
        self._clock = clock or SystemClock()
        self._session = session
        self._registry = registry
        self._hub = hub
        self._prober = prober
        self._calibrator = calibrator
        self._metrics = metrics
        self._on_admitted = on_admitted
        self._on_retired = on_retired
        self._retrying: dict[str, asyncio.Task[None]] = {}
        self._unnamable: set[str] = set()  # ids the engine lists that no request could name

    async def _poll(self) -> list[str]:
        try:
            models, unnamable = await poll_models(
                self._session, self.s.upstream_base_url, self.s.discovery_request_timeout_ms / 1000.0
            )
        except DiscoveryError:
            self._metrics.discovery_polls.labels(PROVIDER, "error").inc()
            raise
        for model in sorted(unnamable - self._unnamable):  # once each, while the engine lists it
            log.warning("model %.100r left out: %s", model, model_id_problem(model))
        self._unnamable = unnamable
        self._metrics.discovery_polls.labels(PROVIDER, "success").inc()
        self._metrics.discovery_models.labels(PROVIDER).set(len(models))
        return models

    async def _initialize(self, gen: Generation) -> None:
        """Probe (when probing) then calibrate (when configured); raises on failure."""
        if self.s.probing_enabled and not await self._prober.probe(self.s.bringup_timeout_ms / 1000.0):
            raise StartupError(f"upstream health probe failed for model {gen.model_id}")
        if self._calibrator is not None:
            started = self._clock.monotonic()
            try:
                await self._calibrator.run(gen)
            except CalibrationError:
                elapsed_ms = (self._clock.monotonic() - started) * 1000
                self._metrics.calibration_ms.labels(gen.model_id, "error").set(elapsed_ms)
                raise
            elapsed_ms = (self._clock.monotonic() - started) * 1000
            self._metrics.calibration_ms.labels(gen.model_id, "completed").set(elapsed_ms)

    def _allocate(self, model: str) -> Generation:
        gen = self._registry.allocate(model)
        self._hub.init_generation(gen, calibrating=self.s.do_calibration)
        return gen

    def _admit(self, gen: Generation) -> None:
        if self._registry.publish(gen):
            self._on_admitted(gen)

    async def start(self) -> None:
        if self.s.probing_enabled:
            healthy = await self._prober.wait_healthy(
                timeout_s=self.s.bringup_timeout_ms / 1000.0, wait_ms=self.s.health_wait_ms
            )
            if not healthy:
                raise StartupError(
                    f"upstream health check failed during pylon startup: no 2xx from "
                    f"{self.s.upstream_base_url} on {', '.join(self._prober.paths)} within "
                    f"{self.s.health_wait_ms} ms (last: {detail(self._prober.last_failure)}; "
                    "--upstream-http-base-url, --upstream-health-path, --upstream-health-wait-ms)"
                )
        if self.s.discovery_mode:
            try:
                models = await self._poll()
            except DiscoveryError as exc:
                raise StartupError(f"initial model discovery failed: {exc}") from exc
        else:
            models = list(self.s.model_names)
        for model in sorted(models):
            gen = self._allocate(model)
            try:
                await self._initialize(gen)
            except StargateError as exc:
                raise StartupError(f"pylon initial model initialization failed: {exc}") from exc
            self._admit(gen)

    def _retire(self, model: str) -> None:
        task = self._retrying.pop(model, None)
        if task is not None:
            task.cancel()
        gen = self._registry.retire(model)
        if gen is not None:
            self._hub.retire_generation(gen)
            self._on_retired(gen)

    async def _init_until_admitted(self, gen: Generation, retry_s: float) -> None:
        while self._registry.is_current(gen):
            try:
                await self._initialize(gen)
            except StargateError as exc:
                log.warning("model %s initialization failed, retrying: %s", gen.model_id, exc)
                await self._clock.sleep(retry_s)
                continue
            self._admit(gen)
            return

    async def reconcile(self, models: list[str]) -> None:
        """Retire models no longer listed; start initialization of new ones."""
        wanted = set(models)
        for model in self._registry.model_ids():
            if model not in wanted:
                self._retire(model)
        loop = asyncio.get_running_loop()
        for model in sorted(wanted):
            if self._registry.current(model) is None:
                gen = self._allocate(model)
                self._retrying[model] = loop.create_task(
                    self._init_until_admitted(gen, self.s.discovery_poll_interval_ms / 1000.0)
                )

    async def run_discovery(self) -> None:
        """Poll every interval; a failed poll keeps the last-known-good set."""
        interval = self.s.discovery_poll_interval_ms / 1000.0
        while True:
            await self._clock.sleep(interval)
            try:
                models = await self._poll()
            except DiscoveryError as exc:
                log.warning("model discovery poll failed; keeping last known models: %s", exc)
                continue
            await self.reconcile(models)

    async def close(self) -> None:
        tasks = list(self._retrying.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
