"""`WatchStargates` content (spec §5.7): the Stargate list and the remote watch URLs, normalised.

The control plane polls peer discovery (``stargate.router.discovery``) every ``--dns-poll-ms`` and
offers each result to a ``WatchPublisher``, which streams it to every watcher when it changed or
``--watch-heartbeat-ms`` passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from stargate.proto import stargate_pb2
from stargate.wire.address import join_host_port
from stargate.wire.clock import Clock, SystemClock

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class StargateEntry:
    stargate_id: str
    advertise_addr: str
    http_advertise_addr: str = ""
    grpc_pylon_dial_addr: str = ""


def normalize_stargates(
    entries: Iterable[StargateEntry], grpc_pylon_dial_addr: str | None
) -> list[StargateEntry]:
    """Group by ``advertise_addr`` (a later non-empty id wins over earlier or empty ones), then
    de-duplicate by id (or address when the id is empty) and sort by that key."""
    by_addr: dict[str, StargateEntry] = {}
    for entry in entries:
        kept = by_addr.get(entry.advertise_addr)
        if kept is None or entry.stargate_id:
            by_addr[entry.advertise_addr] = entry
    by_key: dict[str, StargateEntry] = {}
    for entry in by_addr.values():
        by_key.setdefault(entry.stargate_id or entry.advertise_addr, entry)
    dial = (grpc_pylon_dial_addr or "").strip()
    ordered = [by_key[k] for k in sorted(by_key)]
    return [replace(e, grpc_pylon_dial_addr=dial) for e in ordered] if dial else ordered


def url_key(raw: str) -> str:
    """``host:port`` identity of a watch URL (``http://`` assumed); ``ValueError`` if unusable: a
    scheme other than http(s) or a host no resolver answers (``foo bar``), which every Pylon was sent
    and retried for ever."""
    text = raw.strip()
    parts = urlsplit(text if "://" in text else f"http://{text}")
    host = parts.hostname
    port = parts.port if parts.port is not None else _DEFAULT_PORTS.get(parts.scheme.lower())
    if not host or port is None or parts.scheme.lower() not in _DEFAULT_PORTS or _unusable(host):
        raise ValueError(f"not a host:port watch URL: {raw!r}")
    return join_host_port(host, port)


def _unusable(host: str) -> bool:
    return any(c.isspace() or c in "/?#@[]" for c in host)


def self_endpoint_keys(advertise_addr: str, discovery_dns_name: str | None, port: int) -> set[str]:
    """Keys that name this Stargate: its advertised address and its discovery DNS names."""
    names = [advertise_addr]
    if discovery_dns_name:
        names.append(f"{discovery_dns_name}:{port}")
        names.append(f"{discovery_dns_name.replace('-headless.', '.')}:{port}")
    keys: set[str] = set()
    for name in names:
        try:
            keys.add(url_key(name))
        except ValueError:
            continue
    return keys


def normalize_watch_urls(raw_urls: Iterable[str], exclude_keys: set[str]) -> list[str]:
    """Trimmed, non-blank URLs, one per ``host:port`` key (first spelling kept), sorted by key,
    without this Stargate's own endpoints. Unusable URLs raise ``ValueError``."""
    by_key: dict[str, str] = {}
    for raw in raw_urls:
        text = raw.strip()
        if not text:
            continue
        key = url_key(text)
        if key not in exclude_keys:
            by_key.setdefault(key, text)
    return [by_key[k] for k in sorted(by_key)]


def build_response(
    entries: Iterable[StargateEntry], urls: Iterable[str]
) -> stargate_pb2.WatchStargatesResponse:
    return stargate_pb2.WatchStargatesResponse(
        stargates=[
            stargate_pb2.StargateInfo(
                stargate_id=e.stargate_id,
                advertise_addr=e.advertise_addr,
                http_advertise_addr=e.http_advertise_addr,
                grpc_pylon_dial_addr=e.grpc_pylon_dial_addr,
            )
            for e in entries
        ],
        watch_stargate_urls=list(urls),
    )


class WatchPublisher:
    """The published snapshot, shared by every open watch stream.

    ``offer`` publishes a snapshot whose content changed and wakes every stream; a stream that saw
    no publication for ``heartbeat_s`` re-sends the current snapshot (identical heartbeats).
    """

    def __init__(
        self, snapshot: stargate_pb2.WatchStargatesResponse, heartbeat_s: float, clock: Clock | None = None
    ) -> None:
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self._clock = clock or SystemClock()
        self._version = 0
        self._published = asyncio.Event()

    @property
    def snapshot(self) -> stargate_pb2.WatchStargatesResponse:
        return self._snapshot

    def offer(self, snapshot: stargate_pb2.WatchStargatesResponse) -> bool:
        if snapshot == self._snapshot:
            return False
        self._snapshot = snapshot
        self._version += 1
        self._published.set()
        self._published = asyncio.Event()
        return True

    async def stream(self, stopping: asyncio.Event) -> AsyncIterator[stargate_pb2.WatchStargatesResponse]:
        """The current snapshot at once (when non-empty), then every publication, and the current
        snapshot again after each ``heartbeat_s`` without one, until ``stopping``."""
        sent = self._version
        if self._snapshot.stargates or self._snapshot.watch_stargate_urls:
            yield self._snapshot
        while not stopping.is_set():
            if sent == self._version:
                waits = (
                    asyncio.ensure_future(self._published.wait()),
                    asyncio.ensure_future(stopping.wait()),
                    asyncio.ensure_future(self._clock.sleep(self._heartbeat_s)),
                )
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiting in waits:
                        waiting.cancel()
                if stopping.is_set():
                    return
            sent = self._version
            yield self._snapshot
