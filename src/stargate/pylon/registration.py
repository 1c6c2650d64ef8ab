"""Registration with every Stargate replica (spec pylon.md §9, stargate.md §5.3, §5.7).

``StargateDiscovery`` watches ``WatchStargates`` on the seed and, transitively, on every
announced watch URL; a URL whose stream ends loses its routers until it reconnects (retry 1 s).
The first router set is published once every desired URL delivered a snapshot, or after 5 s
with at least one router. ``RegistrationClient`` keeps one ``RegisterInferenceServer`` stream
per published router and sends the full snapshot every ``--min-update-interval-ms``, and
``--stats-update-coalesce-ms`` after a change of Pylon's own load (``notify``), so what Stargate
sees of Pylon's in-flight requests is at most that old instead of up to a heartbeat old.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from stargate.balancer.types import ModelStats
from stargate.proto import stargate_pb2, stargate_pb2_grpc

log = logging.getLogger("stargate.pylon.registration")
HEARTBEAT_METADATA = "x-stargate-registration-heartbeat-ms"
RETRY_S = 1.0
INITIAL_DISCOVERY_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class RouterInfo:
    router_id: str
    authority: str
    dial_url: str


def with_scheme(url: str) -> str:
    url = url.strip()
    return url if "://" in url else "http://" + url


def router_from_info(info: stargate_pb2.StargateInfo) -> RouterInfo | None:
    router_id = info.stargate_id.strip() or info.advertise_addr.strip()
    if not router_id:
        return None
    authority = info.advertise_addr.strip() or router_id
    dial = info.grpc_pylon_dial_addr.strip() or authority
    return RouterInfo(router_id, authority, with_scheme(dial))


def open_channel(url: str, authority: str | None = None) -> grpc.aio.Channel:
    scheme, _, target = with_scheme(url).partition("://")
    target = target.rstrip("/")
    options = [("grpc.default_authority", authority)] if authority else []
    if scheme == "https":
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


class StargateDiscovery:
    def __init__(
        self,
        seeds: list[str],
        on_change: Callable[[dict[str, RouterInfo]], None],
        *,
        retry_s: float = RETRY_S,
        initial_timeout_s: float = INITIAL_DISCOVERY_TIMEOUT_S,
    ) -> None:
        self._seeds = [with_scheme(s) for s in seeds if s.strip()]
        if not self._seeds:
            raise ValueError("no Stargate seed address")
        self._on_change = on_change
        self._retry_s = retry_s
        self._initial_timeout_s = initial_timeout_s
        self._snapshots: dict[str, list[RouterInfo]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._published: dict[str, RouterInfo] | None = None
        self._timed_out = False

    def _routers(self) -> dict[str, RouterInfo]:
        out: dict[str, RouterInfo] = {}
        for url in sorted(self._snapshots):
            for router in self._snapshots[url]:
                out.setdefault(router.router_id, router)
        return out

    def _maybe_publish(self) -> None:
        routers = self._routers()
        if self._published is None:
            complete = all(url in self._snapshots for url in self._tasks)
            if not (complete or (self._timed_out and routers)):
                return
        if routers != self._published:
            self._published = routers
            self._on_change(dict(routers))

    def _ensure_watch(self, url: str) -> None:
        if url not in self._tasks:
            self._tasks[url] = asyncio.get_running_loop().create_task(self._watch(url))

    async def _watch(self, url: str) -> None:
        while True:
            channel = open_channel(url)
            try:
                stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
                async for msg in stub.WatchStargates(stargate_pb2.WatchStargatesRequest()):
                    routers = [r for info in msg.stargates if (r := router_from_info(info)) is not None]
                    self._snapshots[url] = routers
                    for extra in msg.watch_stargate_urls:
                        if extra.strip():
                            self._ensure_watch(with_scheme(extra))
                    self._maybe_publish()
            except grpc.aio.AioRpcError as exc:
                log.debug("WatchStargates on %s failed: %s", url, exc.code())
            finally:
                await channel.close()
            if self._snapshots.pop(url, None) is not None:
                self._maybe_publish()
            await asyncio.sleep(self._retry_s)

    async def run(self) -> None:
        for seed in self._seeds:
            self._ensure_watch(seed)
        try:
            await asyncio.sleep(self._initial_timeout_s)
            self._timed_out = True
            self._maybe_publish()
            await asyncio.Event().wait()
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)


class RegistrationClient:
    """One registration stream per router; ``snapshot`` builds the full registration message."""

    def __init__(
        self,
        *,
        snapshot: Callable[[], stargate_pb2.InferenceServerRegistration],
        interval_ms: int,
        token: Callable[[], str | None],
        on_connected: Callable[[str, bool], None] = lambda _router, _up: None,
        retry_s: float = RETRY_S,
        coalesce_ms: int = 0,
    ) -> None:
        self._snapshot = snapshot
        self._interval_s = interval_ms / 1000.0
        self._interval_ms = interval_ms
        self._coalesce_s = coalesce_ms / 1000.0
        self._token = token
        self._on_connected = on_connected
        self._retry_s = retry_s
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._changed: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()

    @property
    def routers(self) -> list[str]:
        return sorted(self._streams)

    def update_routers(self, routers: dict[str, RouterInfo]) -> None:
        for router_id in [r for r in self._streams if r not in routers]:
            self._streams.pop(router_id).cancel()
        loop = asyncio.get_running_loop()
        for router_id, info in routers.items():
            if router_id not in self._streams:
                self._streams[router_id] = loop.create_task(self._run_router(info))

    def notify(self) -> None:
        """The snapshot changed: each stream sends it after the coalesce delay (0 = heartbeats only)."""
        if self._coalesce_s > 0:
            for changed in self._changed:
                changed.set()

    async def _messages(self) -> AsyncIterator[stargate_pb2.InferenceServerRegistration]:
        changed = asyncio.Event()
        self._changed.add(changed)
        while True:
            changed.clear()
            yield self._snapshot()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await changed.wait()
                    await asyncio.sleep(self._coalesce_s)  # later changes ride along

    def _metadata(self) -> list[tuple[str, str]]:
        md = [(HEARTBEAT_METADATA, str(self._interval_ms))]
        token = self._token()
        if token:
            md.append(("authorization", f"Bearer {token}"))
        return md

    async def _run_router(self, info: RouterInfo) -> None:
        channel = open_channel(info.dial_url, info.authority)
        stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        try:
            while True:
                acked = False
                try:
                    call = stub.RegisterInferenceServer(self._messages(), metadata=self._metadata())
                    async for _ack in call:
                        if not acked:
                            acked = True
                            self._on_connected(info.router_id, True)
                except grpc.aio.AioRpcError as exc:
                    log.info("registration stream to %s ended: %s", info.router_id, exc.code())
                finally:
                    if acked:
                        self._on_connected(info.router_id, False)
                if not acked:
                    await asyncio.sleep(self._retry_s)
        finally:
            await channel.close()

    async def close(self) -> None:
        tasks = list(self._streams.values())
        self._streams.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_source(static: str | None, file: str | None) -> Callable[[], str | None]:
    """Static token wins; otherwise the file is re-read (trimmed) each time a stream opens."""

    def read() -> str | None:
        if static:
            return static
        if file:
            with contextlib.suppress(OSError):
                return Path(file).read_text().strip() or None
        return None

    return read


def stats_to_proto(stats: ModelStats) -> stargate_pb2.ModelStats:
    return stargate_pb2.ModelStats(
        last_mean_input_tps=stats.last_mean_input_tps,
        output_tps=stats.output_tps,
        queue_size=stats.queue_size,
        queued_input_size=stats.queued_input_size,
        max_output_tps=stats.max_output_tps,
        kv_cache_capacity_tokens=stats.kv_cache_capacity_tokens,
        kv_cache_used_tokens=stats.kv_cache_used_tokens,
        kv_cache_free_tokens=stats.kv_cache_free_tokens,
        num_running_queries=stats.num_running_queries,
        max_engine_concurrency=stats.max_engine_concurrency,
        total_query_input_size=stats.total_query_input_size,
        queue_time_estimate_ms_by_priority=dict(stats.queue_time_estimate_ms_by_priority),
        input_processing_queries=stats.input_processing_queries,
        output_generation_queries=stats.output_generation_queries,
        stats_observed_at_unix_ms=stats.stats_observed_at_unix_ms,
        stats_capabilities=list(stats.stats_capabilities),
        stats_sources=list(stats.stats_sources),
    )
