"""Consistent-hash affinity ring (spec §3.4) and the bounded key cache shared with Pulsar.

Byte layout is a wire-stable contract (Appendix A): ``tagged(tag, v) = tag || 0xFF || u64_le(len v)
|| v``, hashed with seed-0 XXH3-64. The ring is built once per candidate cluster-id sequence.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

import xxhash

from stargate.balancer.types import Target

_xxh3 = xxhash.xxh3_64_intdigest

V = TypeVar("V")

CACHE_CAPACITY = 4096
MAX_CACHED_KEY_BYTES = 256


def tagged(tag: bytes, value: bytes) -> bytes:
    return tag + b"\xff" + len(value).to_bytes(8, "little") + value


def hash_prefix(seed: str, target: Target) -> bytes:
    """``0x01 || seed || routing_key || model_id``: the common start of every ring/rendezvous hash."""
    return (
        b"\x01"
        + tagged(b"seed", seed.encode())
        + tagged(b"routing_key", (target.routing_key or "").encode())
        + tagged(b"model_id", target.model_id.encode())
    )


def virtual_node_hash(prefix: bytes, cluster_id: str, node: int) -> int:
    return _xxh3(
        prefix
        + tagged(b"cluster_id", cluster_id.encode())
        + tagged(b"virtual_node", node.to_bytes(8, "little"))
    )


def key_hash(prefix: bytes, cache_affinity_key: str) -> int:
    return _xxh3(prefix + tagged(b"cache_affinity_key", cache_affinity_key.encode()))


class AffinityRing:
    """Virtual nodes of every candidate (excluded ones included), sorted by (hash, cluster id, index)."""

    __slots__ = ("_hashes", "_owners", "_prefix", "_size")

    def __init__(self, prefix: bytes, cluster_ids: Sequence[str], virtual_nodes: int) -> None:
        entries = sorted(
            (virtual_node_hash(prefix, cluster_id, node), cluster_id, index)
            for index, cluster_id in enumerate(cluster_ids)
            for node in range(max(1, virtual_nodes))
        )
        self._prefix = prefix
        self._hashes = [entry[0] for entry in entries]
        self._owners = [entry[2] for entry in entries]
        self._size = len(cluster_ids)

    def select(self, cache_affinity_key: str, count: int) -> tuple[int, ...]:
        """The first ``min(count, N)`` distinct clusters clockwise from the key's position."""
        wanted = min(count, self._size)
        hashes, owners = self._hashes, self._owners
        if wanted <= 0 or not hashes:
            return ()
        position = bisect_left(hashes, key_hash(self._prefix, cache_affinity_key))
        total = len(hashes)
        picked: list[int] = []
        for step in range(total):
            owner = owners[(position + step) % total]
            if owner not in picked:
                picked.append(owner)
                if len(picked) == wanted:
                    break
        return tuple(picked)


def cacheable_key(key: str) -> bool:
    """Keys longer than 256 UTF-8 bytes are never cached (they are rarely repeated and costly to hold)."""
    if len(key) * 4 <= MAX_CACHED_KEY_BYTES:
        return True
    return len(key) <= MAX_CACHED_KEY_BYTES and len(key.encode()) <= MAX_CACHED_KEY_BYTES


class KeyCache(Generic[V]):
    """Bounded FIFO map from affinity key to a derived value; a pure speed-up, never a behaviour.

    When full, a key is admitted only on its second miss (evicting the oldest entry), so a stream
    of one-off keys cannot flush the keys that do repeat.
    """

    __slots__ = ("_capacity", "_entries", "_seen")

    def __init__(self, capacity: int = CACHE_CAPACITY) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._seen: dict[str, None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> V | None:
        return self._entries.get(key)

    def put(self, key: str, value: V) -> None:
        if not cacheable_key(key):
            return
        entries = self._entries
        if len(entries) >= self._capacity:
            seen = self._seen
            if key not in seen:
                if len(seen) >= self._capacity:
                    seen.clear()
                seen[key] = None
                return
            del seen[key]
            entries.popitem(last=False)
        entries[key] = value

    def clear(self) -> None:
        self._entries.clear()
        self._seen.clear()
