"""KV prefix-cache models: capacity and LRU accounting in tokens, two ways to key an entry.

* :class:`AffinityKVCache` (``--kv-cache-mode affinity``, the original): one entry per
  ``x-cache-affinity-key`` holding a token count (mock-engine spec §6).
* :class:`PrefixKVCache` (``--kv-cache-mode prefix``): entries are fixed-size blocks of the
  prompt bytes (``block_tokens x BYTES_PER_TOKEN`` bytes each), keyed by a chained xxh3 hash so a
  block matches only after the same preceding text; the longest cached run of leading blocks is
  reused. Only full blocks are cached, as in vLLM.

Both follow one protocol: :meth:`access` before prefill (counts hit/miss, refreshes LRU),
:meth:`commit` (stores, evicts) of the prompt's first ``computed`` tokens, or all of it. The
continuous and independent modes commit once the prefill is over, so a concurrent request with the
same prefix misses the blocks still being prefilled; the vllm mode commits each chunk as it is
scheduled, as vLLM does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from .tokens import BYTES_PER_TOKEN

MAX_ENTRIES = 1 << 22


@dataclass(frozen=True, slots=True)
class Lookup:
    hit: bool
    reused: int
    uncached: int
    key: str | None = None
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Eviction:
    entries: int = 0
    tokens: int = 0


NO_EVICTION = Eviction()


class _Counters:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = max(0, capacity_tokens)
        self.used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self.query_tokens = 0
        self.hit_tokens = 0

    def count(self, reused: int, input_tokens: int) -> None:
        self.query_tokens += input_tokens
        self.hit_tokens += reused
        if reused > 0:
            self.hits += 1
        else:
            self.misses += 1


class KVCache(Protocol):
    mode: str

    def access(self, affinity_key: str | None, prompt: bytes, input_tokens: int) -> Lookup: ...

    def commit(self, lookup: Lookup, input_tokens: int, computed: int | None = None) -> Eviction: ...

    def stats(self, model: str) -> dict[str, Any]: ...

    @property
    def counters(self) -> _Counters: ...

    @property
    def entries(self) -> int: ...


def _stats(model: str, counters: _Counters, entries: int) -> dict[str, Any]:
    return {
        "model": model,
        "kv_cache_capacity_tokens": counters.capacity,
        "kv_cache_used_tokens": counters.used,
        "kv_cache_free_tokens": max(0, counters.capacity - counters.used),
        "kv_cache_entries": entries,
        "kv_cache_hit_count": counters.hits,
        "kv_cache_miss_count": counters.misses,
        "kv_cache_eviction_count": counters.evictions,
        "kv_cache_evicted_tokens": counters.evicted_tokens,
    }


class AffinityKVCache:
    """key → cached tokens, LRU by key; a follow-up never shrinks an entry (spec §6.2)."""

    mode = "affinity"

    def __init__(self, capacity_tokens: int) -> None:
        self._c = _Counters(capacity_tokens)
        self._lru: OrderedDict[str, int] = OrderedDict()

    @property
    def counters(self) -> _Counters:
        return self._c

    @property
    def entries(self) -> int:
        return len(self._lru)

    def access(self, affinity_key: str | None, prompt: bytes, input_tokens: int) -> Lookup:
        reused = 0
        if self._c.capacity > 0 and affinity_key:
            cached = self._lru.get(affinity_key)
            if cached is not None:
                self._lru.move_to_end(affinity_key)
                reused = min(cached, input_tokens)
        self._c.count(reused, input_tokens)
        return Lookup(reused > 0, reused, input_tokens - reused, key=affinity_key)

    def commit(self, lookup: Lookup, input_tokens: int, computed: int | None = None) -> Eviction:
        key = lookup.key
        if self._c.capacity <= 0 or not key:
            return NO_EVICTION
        previous = self._lru.pop(key, None)
        if previous is not None:
            self._c.used -= previous
        retained = max(previous or 0, input_tokens if computed is None else min(computed, input_tokens))
        entries = tokens = 0
        if retained > self._c.capacity:
            if previous is not None:
                entries, tokens = 1, previous
        else:
            while self._lru and (self._c.used + retained > self._c.capacity or len(self._lru) >= MAX_ENTRIES):
                _, evicted = self._lru.popitem(last=False)
                self._c.used -= evicted
                entries += 1
                tokens += evicted
            self._lru[key] = retained
            self._c.used += retained
        self._c.evictions += entries
        self._c.evicted_tokens += tokens
        return Eviction(entries, tokens) if entries else NO_EVICTION

    def stats(self, model: str) -> dict[str, Any]:
        return _stats(model, self._c, len(self._lru))


def block_hashes(prompt: bytes, block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``prompt`` (each hash seeds the next)."""
    size = block_tokens * BYTES_PER_TOKEN
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(prompt) - size + 1, size):
        previous = xxhash.xxh3_64_intdigest(prompt[start : start + size], seed=previous)
        hashes.append(previous)
    return tuple(hashes)


class PrefixKVCache:
    """Block-hash prefix cache; ``kv_cache_entries`` counts blocks, tokens = blocks x block size."""

    mode = "prefix"

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self._c = _Counters(capacity_tokens)
        self._block = block_tokens
        self._max_blocks = min(self._c.capacity // block_tokens, MAX_ENTRIES)
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def counters(self) -> _Counters:
        return self._c

    @property
    def entries(self) -> int:
        return len(self._lru)

    @property
    def block_tokens(self) -> int:
        return self._block

    def access(self, affinity_key: str | None, prompt: bytes, input_tokens: int) -> Lookup:
        if self._max_blocks <= 0:
            self._c.count(0, input_tokens)
            return Lookup(False, 0, input_tokens)
        blocks = block_hashes(prompt, self._block)
        matched = 0
        for block in blocks:
            if block not in self._lru:
                break
            matched += 1
        for block in reversed(blocks[:matched]):
            self._lru.move_to_end(block)  # parents end up most recent: leaves are evicted first
        reused = min(matched * self._block, input_tokens)
        self._c.count(reused, input_tokens)
        return Lookup(reused > 0, reused, input_tokens - reused, blocks=blocks)

    def commit(self, lookup: Lookup, input_tokens: int, computed: int | None = None) -> Eviction:
        if self._max_blocks <= 0 or not lookup.blocks:
            return NO_EVICTION
        count = len(lookup.blocks)
        if computed is not None and 0 <= computed < input_tokens:
            # The prompt's bytes and its token count (the x-input-tokens header) may differ: the
            # computed share of its blocks.
            count = count * computed // input_tokens
        wanted = lookup.blocks[: min(count, self._max_blocks)]
        if not wanted:
            return NO_EVICTION
        missing = sum(1 for block in wanted if block not in self._lru)
        evicted = max(0, len(self._lru) + missing - self._max_blocks)
        if evicted:
            for block in wanted:  # protect this request's cached blocks from its own evictions
                if block in self._lru:
                    self._lru.move_to_end(block)
            for _ in range(evicted):
                self._lru.popitem(last=False)
        for block in reversed(wanted):
            if block in self._lru:
                self._lru.move_to_end(block)
            else:
                self._lru[block] = None
        self._c.used = len(self._lru) * self._block
        if not evicted:
            return NO_EVICTION
        self._c.evictions += evicted
        self._c.evicted_tokens += evicted * self._block
        return Eviction(evicted, evicted * self._block)

    def stats(self, model: str) -> dict[str, Any]:
        return _stats(model, self._c, len(self._lru))
