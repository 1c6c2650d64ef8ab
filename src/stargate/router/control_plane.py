"""The gRPC control plane: Pylon registration streams, `WatchStargates` and `ListModels` (spec §5).

Registration streams end on client close, read error, idle timeout, validation error or shutdown;
on every end the backend's probing stops and ``RoutingState.remove`` drops its routes, releases its
id and retires its cluster generation, in that order, before the stream's final status is sent.
The idle timeout runs on the injected clock. Every applied update is acknowledged, also when the
health probe failed (the update then removes the backend's ACTIVE routes; §5.5 of the original
skips the ack only when a QUIC tunnel cannot be opened, which has no HTTP equivalent).
Between updates the backend's health prober ejects it from routing after consecutive failed probes
(not counted while the backend answers requests) and re-applies its latest update when a probe
succeeds again (``router/health.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NoReturn

import aiohttp
import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from stargate.balancer.types import ModelStats
from stargate.errors import ConfigError, DiscoveryFailed, RegistrationRejected, RequestError
from stargate.proto import stargate_pb2, stargate_pb2_grpc
from stargate.router import watch
from stargate.router.discovery import DiscoverySettings, PeerDiscovery, with_self
from stargate.router.health import HealthProber, HealthSettings, LoopLag, wait_stopped
from stargate.router.registration import (
    Identity,
    OpenAuthenticator,
    WorkerAuthenticator,
    admit_first,
    bearer_token,
    check_identity,
    idle_timeout_ms,
    metadata_value,
    model_updates,
)
from stargate.router.state import SERVER_ERROR_HOLD_S, RegistrationHandle, RoutingState
from stargate.wire import headers as h
from stargate.wire.address import join_host_port, split_host_port
from stargate.wire.clock import Clock, SystemClock

log = logging.getLogger(__name__)

_AddServicer = Callable[[object, aio.Server], None]
_add_control_plane: _AddServicer = stargate_pb2_grpc.add_StargateControlPlaneServicer_to_server
_add_discovery: _AddServicer = stargate_pb2_grpc.add_StargateModelDiscoveryServicer_to_server

_EMPTY_ACK = stargate_pb2.InferenceServerAck()
SHUTDOWN_MESSAGE = "stargate is shutting down"
REPLACED_MESSAGE = "replaced by a new registration of the same inference_server_id"
REPLACE_WAIT_S = 5.0
"""How long a new registration waits for the out-of-routing one it replaces to end."""
STALL_S = 1.0
"""An idle timer that fires this much past its deadline means the router was not running."""
STALL_GRACE_S = 1.0
"""How long a stream whose idle timer fired late is given to deliver what it sent meanwhile: a
router stopped for longer than the idle timeout (SIGSTOP, a paused VM) dropped every registration
on resume before reading their heartbeats, and answered 404 until the Pylons registered again."""
UNDECODABLE_MESSAGE = "registration message is not a valid InferenceServerRegistration"


@dataclass(frozen=True)
class ControlPlaneSettings:
    stargate_id: str
    advertise_addr: str
    """Self gRPC address published by `WatchStargates`; port 0 becomes the bound port."""
    http_advertise_addr: str
    grpc_pylon_dial_addr: str | None = None
    remote_stargate_urls: tuple[str, ...] = ()
    discovery_dns_name: str | None = None
    discovery: DiscoverySettings = field(default_factory=DiscoverySettings)
    watch_heartbeat_ms: int = 5000
    idle_timeout_floor_ms: int = 60000
    idle_timeout_cap_ms: int = 300000
    health: HealthSettings = field(default_factory=HealthSettings)
    auth_timeout_s: float = 10.0
    max_registrations: int = 10_000
    max_models_per_registration: int = 4096
    max_message_bytes: int = 4 * 1024 * 1024
    via: str | None = None
    """This router's ``Via`` name, sent with its health probes (``router/health.py``)."""

    def validate(self) -> None:
        """Reject settings that would break the control plane at run time, naming the flag."""
        for flag, value in (
            ("--watch-heartbeat-ms", self.watch_heartbeat_ms),
            ("--registration-update-idle-timeout-ms", self.idle_timeout_floor_ms),
            ("--registration-update-max-idle-timeout-ms", self.idle_timeout_cap_ms),
        ):
            if value < 0:
                raise ConfigError("value must not be negative", path=flag)
        if self.watch_heartbeat_ms == 0:
            raise ConfigError("value must be greater than 0", path="--watch-heartbeat-ms")
        for raw in self.remote_stargate_urls:
            if raw.strip():
                try:
                    watch.url_key(raw)
                except ValueError as exc:
                    raise ConfigError(f"invalid URL {raw.strip()!r}", path="--remote-stargate-url") from exc


@dataclass(slots=True)
class _LiveStream:
    """A registration stream being served: whether its health probes took it out of routing, and
    the events by which a new registration of its id replaces it (``ControlPlane._replaced``)."""

    ejected: bool = False
    replaced: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class _StreamEnd(Exception):
    """Ends a registration stream with ``code`` and ``message`` (sent once its routes are gone)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _abort(
    context: aio.ServicerContext[object, object], code: grpc.StatusCode, message: str
) -> NoReturn:
    """End the RPC with a status; ``abort`` always raises."""
    await context.abort(code, message)
    raise AssertionError("ServicerContext.abort returned")


def _bound_advertise(advertise: str, listen: str, port: int) -> str:
    """``advertise`` with the bound port when it names the listener's port (``:0`` becomes real)."""
    try:
        host, advertised = split_host_port(advertise)
        _, listening = split_host_port(listen)
    except ValueError:
        return advertise
    return join_host_port(host, port) if advertised == listening else advertise


class ControlPlane:
    """Owns the gRPC server(s); the registration streams mutate the shared ``RoutingState``."""

    def __init__(
        self,
        state: RoutingState,
        settings: ControlPlaneSettings,
        session: aiohttp.ClientSession,
        *,
        authenticator: WorkerAuthenticator | None = None,
        clock: Clock | None = None,
    ) -> None:
        settings.validate()
        self._state = state
        self._clock = clock or SystemClock()
        self._settings = settings
        self._session = session
        self._authenticator: WorkerAuthenticator = authenticator or OpenAuthenticator()
        self._servers: list[aio.Server] = []
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self._publisher: watch.WatchPublisher | None = None
        self._discovery: PeerDiscovery | None = None
        self._poller: asyncio.Task[None] | None = None
        self._loop_lag = LoopLag(settings.health.late_loop_s)
        self._hold_outs: dict[str, Callable[[str, int], None]] = {}  # per live backend: a model held out
        self._streams: dict[str, _LiveStream] = {}  # per live backend: its registration stream
        state.on_server_errors = self._server_errors
        self._loop_lag_task: asyncio.Task[None] | None = None
        self._control_port = 0
        self.advertise_addr = settings.advertise_addr

    async def start(self, listen_addr: str, model_discovery_listen_addr: str) -> tuple[int, int]:
        """Bind and start; returns the bound (control plane, model discovery) ports."""
        shared = listen_addr == model_discovery_listen_addr
        control = self._new_server()
        _add_control_plane(_ControlPlaneServicer(self), control)
        discovery = control if shared else self._new_server()
        _add_discovery(_DiscoveryServicer(self._state), discovery)
        # Stopped explicitly even when binding fails: a gRPC server left to the garbage collector
        # tears down on whatever loop is running then (or none).
        self._servers = [control] if shared else [control, discovery]
        try:
            control_port = self._bind(control, listen_addr, "--listen-addr")
            if shared:
                discovery_port = control_port
            else:
                flag = "--model-discovery-listen-addr"
                discovery_port = self._bind(discovery, model_discovery_listen_addr, flag)
        except ConfigError:
            await self.stop(0)
            raise
        self.advertise_addr = _bound_advertise(self._settings.advertise_addr, listen_addr, control_port)
        self._control_port = control_port
        self._discovery = PeerDiscovery(self._settings.discovery, control_port)
        self._publisher = watch.WatchPublisher(
            self._build_watch_snapshot(await self._poll_peers()), self.watch_heartbeat_s, self._clock
        )
        for server in self._servers:
            await server.start()
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._poll_discovery(self._publisher))
        self._loop_lag_task = loop.create_task(self._loop_lag.run(), name="event loop lag")
        return control_port, discovery_port

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; open streams end as a shutdown and clean their registrations up."""
        self._stopping.set()
        for task in (self._poller, self._loop_lag_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._poller = self._loop_lag_task = None
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))
        self._servers = []
        await wait_stopped(list(self._probe_tasks))

    def _new_server(self) -> aio.Server:
        limit = self._settings.max_message_bytes
        return aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=self._settings.max_registrations + 1024,
        )

    @staticmethod
    def _bind(server: aio.Server, addr: str, flag: str) -> int:
        try:
            port = server.add_insecure_port(addr)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {addr}: {exc}", path=flag) from exc
        if not isinstance(port, int) or port == 0:
            raise ConfigError(f"cannot listen on {addr}", path=flag)
        return port

    async def _poll_peers(self) -> list[watch.StargateEntry]:
        """One discovery poll; a failure is logged and yields no peers (self only)."""
        assert self._discovery is not None
        try:
            return await self._discovery.peers()
        except DiscoveryFailed as exc:
            log.warning("stargate discovery failed, publishing self only: %s", exc)
            return []

    async def _poll_discovery(self, publisher: watch.WatchPublisher) -> None:
        """Poll every ``--dns-poll-ms`` (the first poll ran at start) and publish what changed."""
        poll_s = self._settings.discovery.poll_ms / 1000.0
        while True:
            await self._clock.sleep(poll_s)
            publisher.offer(self._build_watch_snapshot(await self._poll_peers()))

    def _build_watch_snapshot(self, peers: list[watch.StargateEntry]) -> stargate_pb2.WatchStargatesResponse:
        settings, control_port = self._settings, self._control_port
        own = watch.StargateEntry(settings.stargate_id, self.advertise_addr, settings.http_advertise_addr)
        entries = watch.normalize_stargates(with_self(own, peers), settings.grpc_pylon_dial_addr)
        exclude = watch.self_endpoint_keys(self.advertise_addr, settings.discovery_dns_name, control_port)
        exclude |= watch.self_endpoint_keys(settings.advertise_addr, None, control_port)
        urls = watch.normalize_watch_urls(settings.remote_stargate_urls, exclude)
        return watch.build_response(entries, urls)

    # ---- registration stream -------------------------------------------------------------------

    async def register(self, context: aio.ServicerContext[object, object]) -> None:
        metadata = tuple(context.invocation_metadata() or ())
        try:
            routing_key = await asyncio.wait_for(
                self._authenticator.authenticate(bearer_token(metadata)), self._settings.auth_timeout_s
            )
        except Exception:
            log.warning("registration rejected: authentication failed", exc_info=True)
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, "authentication failed")
        timeout_ms = idle_timeout_ms(
            metadata_value(metadata, h.HEARTBEAT_METADATA),
            self._settings.idle_timeout_floor_ms,
            self._settings.idle_timeout_cap_ms,
        )
        idle_s = None if timeout_ms is None else timeout_ms / 1000.0
        try:
            first = await self._read(context, idle_s)
        except _StreamEnd as end:
            await _abort(context, end.code, end.message)
        if first is None:
            return
        try:
            identity = admit_first(first, reverse_listener=False)
        except RegistrationRejected as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        if self._state.registration_count() >= self._settings.max_registrations:
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many registrations (limit {self._settings.max_registrations})",
            )
        handle = self._state.admit(
            identity.inference_server_id, identity.inference_server_url, first.cluster_id, routing_key
        )
        if handle is None and await self._replaced(identity.inference_server_id):
            handle = self._state.admit(
                identity.inference_server_id, identity.inference_server_url, first.cluster_id, routing_key
            )
        if handle is None:
            await _abort(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"inference_server_id '{identity.inference_server_id}' is already registered",
            )
        await self._serve_registration(context, identity, handle, first, idle_s)

    async def _serve_registration(
        self,
        context: aio.ServicerContext[object, object],
        identity: Identity,
        handle: RegistrationHandle,
        first: stargate_pb2.InferenceServerRegistration,
        idle_s: float | None,
    ) -> None:
        settings = self._settings
        backend_id = identity.inference_server_id
        latest: dict[str, ModelStats | None] = {}  # the last update, re-applied when a backend returns

        stream = self._streams[backend_id] = _LiveStream()
        url = identity.inference_server_url
        log.info("backend %s registered at %s (cluster %s)", backend_id, url, handle.backend.cluster_id)

        def eject(failures: int) -> None:
            log.warning(
                "backend %s out of routing: %d health probes in a row of %s failed, the last: %s",
                backend_id, failures, url, prober.last_error,
            )  # fmt: skip
            stream.ejected = True
            self._state.apply_update(handle, dict.fromkeys(latest), None)

        def restore(rtt_ns: int) -> None:
            log.warning("backend %s back in routing: its health probe succeeded", backend_id)
            stream.ejected = False
            self._state.apply_update(handle, latest, rtt_ns)

        holds: dict[str, asyncio.TimerHandle] = {}  # per model held out: the hold's end

        def hold_out(model_id: str, errors: int) -> None:
            log.warning(
                "backend %s out of routing for model %s for %g s: its last %d attempts for it failed"
                " (server errors, 429s without the retry signal, dropped or cut answers)",
                backend_id, model_id, SERVER_ERROR_HOLD_S, errors,
            )  # fmt: skip
            holds[model_id] = asyncio.get_running_loop().call_later(SERVER_ERROR_HOLD_S, hold_over, model_id)

        def hold_over(model_id: str) -> None:
            """The model's routes come back from the latest update, unless the backend's probes
            took it out meanwhile (their success brings them back)."""
            del holds[model_id]
            if not prober.ejected and prober.rtt_ns is not None and latest.get(model_id) is not None:
                self._state.apply_update(handle, latest, prober.rtt_ns)
                log.warning("backend %s back in routing for model %s: its hold ended", backend_id, model_id)

        prober = HealthProber(
            self._session,
            identity.inference_server_url,
            backend_id,
            settings=settings.health,
            on_eject=eject,
            on_restore=restore,
            answering=lambda seconds: self._state.answered_within(backend_id, seconds),
            loop_late=self._loop_lag.late_within,
            via=settings.via,
        )
        message: stargate_pb2.InferenceServerRegistration | None = first
        ended: _StreamEnd | None = None
        self._hold_outs[backend_id] = hold_out
        try:
            while message is not None:
                updates = model_updates(message, max_models=settings.max_models_per_registration)
                latest.clear()
                latest.update(updates)
                rtt_ns = await prober.rtt_for_update()
                if self._stopping.is_set():
                    raise _StreamEnd(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
                self._state.apply_update(handle, updates, rtt_ns)
                prober.start()
                await context.write(_EMPTY_ACK)
                message = await self._read(context, idle_s, stream.replaced)
                if message is not None:
                    check_identity(identity, message)
        except RegistrationRejected as exc:
            ended = _StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        except _StreamEnd as end:
            ended = end
        finally:
            for hold in holds.values():
                hold.cancel()
            if self._streams.get(backend_id) is stream:
                del self._streams[backend_id]
            self._end(prober, handle)
            stream.ended.set()
            how = "its registration stream ended" if ended is None else ended.message
            log.info("backend %s at %s left routing: %s", backend_id, url, how)
        if ended is not None:
            # Sent only now: a client that sees the stream end finds its routes already gone.
            await _abort(context, ended.code, ended.message)

    def _server_errors(self, backend_id: str, model_id: str, errors: int) -> None:
        hold_out = self._hold_outs.get(backend_id)
        if hold_out is not None:
            hold_out(model_id, errors)

    def _end(self, prober: HealthProber, handle: RegistrationHandle) -> None:
        self._hold_outs.pop(handle.backend.inference_server_id, None)
        task = prober.stop()
        if task is not None:
            self._probe_tasks.add(task)
            task.add_done_callback(self._probe_tasks.discard)
        self._state.remove(handle)

    async def _replaced(self, backend_id: str) -> bool:
        """End the live registration of ``backend_id`` for a new one when its health probes took it
        out of routing, and report whether it ended (not in the original: a Pylon restarted under
        the same id, a pod rescheduled while its old node hangs, was refused until the old
        stream's idle timeout, 60 s and more, although the old backend was long out of routing)."""
        stream = self._streams.get(backend_id)
        if stream is None or not stream.ejected:
            return False
        log.warning("backend %s registered again while out of routing: the new one replaces it", backend_id)
        stream.replaced.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REPLACE_WAIT_S):
                await stream.ended.wait()
        return stream.ended.is_set()

    async def _read(
        self,
        context: aio.ServicerContext[object, object],
        idle_s: float | None,
        replaced: asyncio.Event | None = None,
    ) -> stargate_pb2.InferenceServerRegistration | None:
        """The next message; ``None`` at end of stream. Idle timeout, shutdown, replacement and
        undecodable bytes raise ``_StreamEnd``; shutdown wins over a message that is already there."""
        read = asyncio.ensure_future(context.read())
        stop = asyncio.ensure_future(self._stopping.wait())
        waits = {read, stop}
        if replaced is not None:
            waits.add(asyncio.ensure_future(replaced.wait()))
        started = self._clock.monotonic()
        if idle_s is not None:  # on the injected clock, so tests drive the idle timeout
            waits.add(asyncio.ensure_future(self._clock.sleep(idle_s)))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            late = idle_s is not None and self._clock.monotonic() - started > idle_s + STALL_S
            if late and not read.done():
                # The router itself was stopped past the deadline: updates sent meanwhile are
                # still to be read, after the timer that fired first.
                await asyncio.wait({read, stop}, timeout=STALL_GRACE_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                if not waiting.done():
                    waiting.cancel()
        if self._stopping.is_set():
            raise _StreamEnd(grpc.StatusCode.UNAVAILABLE, SHUTDOWN_MESSAGE)
        if replaced is not None and replaced.is_set():
            raise _StreamEnd(grpc.StatusCode.ABORTED, REPLACED_MESSAGE)
        if not read.done():
            raise _StreamEnd(grpc.StatusCode.DEADLINE_EXCEEDED, f"no registration update within {idle_s:g} s")
        try:
            message = read.result()
        except DecodeError:
            # Bytes that are no InferenceServerRegistration: the client's error, not the servicer's.
            raise _StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, UNDECODABLE_MESSAGE) from None
        if message is aio.EOF:
            return None
        assert isinstance(message, stargate_pb2.InferenceServerRegistration)
        return message

    def watch_stream(self) -> AsyncIterator[stargate_pb2.WatchStargatesResponse]:
        assert self._publisher is not None
        return self._publisher.stream(self._stopping)

    @property
    def watch_heartbeat_s(self) -> float:
        return self._settings.watch_heartbeat_ms / 1000.0

    @property
    def stopping(self) -> asyncio.Event:
        return self._stopping


class _ControlPlaneServicer(stargate_pb2_grpc.StargateControlPlaneServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    async def WatchStargates(
        self, request: stargate_pb2.WatchStargatesRequest, context: aio.ServicerContext[object, object]
    ) -> AsyncIterator[stargate_pb2.WatchStargatesResponse]:
        heartbeat_ms = round(self._plane.watch_heartbeat_s * 1000)
        await context.send_initial_metadata(((h.WATCH_HEARTBEAT_METADATA, str(heartbeat_ms)),))
        async for snapshot in self._plane.watch_stream():
            yield snapshot

    async def RegisterInferenceServer(
        self, request_iterator: object, context: aio.ServicerContext[object, object]
    ) -> None:
        await self._plane.register(context)


class _DiscoveryServicer(stargate_pb2_grpc.StargateModelDiscoveryServicer):
    def __init__(self, state: RoutingState) -> None:
        self._state = state

    async def ListModels(
        self, request: stargate_pb2.ListModelsRequest, context: aio.ServicerContext[object, object]
    ) -> stargate_pb2.ListModelsResponse:
        routing_key = request.routing_key if request.HasField("routing_key") else None
        try:
            model_ids = self._state.list_models(routing_key, list(request.model_ids))
        except RequestError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc.message)
        return stargate_pb2.ListModelsResponse(model_ids=model_ids)
