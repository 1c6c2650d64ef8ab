from __future__ import annotations

from stargate.mock_engine.kv_cache import AffinityKVCache, PrefixKVCache, block_hashes


def request(cache: AffinityKVCache, key: str | None, tokens: int) -> tuple[bool, int, int, int]:
    lookup = cache.access(key, b"", tokens)
    eviction = cache.commit(lookup, tokens)
    return lookup.hit, lookup.reused, eviction.entries, eviction.tokens


def test_s9_27_second_request_with_same_key_hits() -> None:
    cache = AffinityKVCache(1000)
    assert request(cache, "cak-a", 100)[0] is False
    assert request(cache, "cak-a", 100)[0] is True
    stats = cache.stats("m")
    assert (stats["kv_cache_used_tokens"], stats["kv_cache_free_tokens"]) == (100, 900)
    assert (stats["kv_cache_hit_count"], stats["kv_cache_miss_count"]) == (1, 1)


def test_s9_28_longer_follow_up_reuses_cached_part() -> None:
    cache = AffinityKVCache(200_000)
    request(cache, "K", 100_000)
    lookup = cache.access("K", b"", 102_000)
    assert (lookup.reused, lookup.uncached) == (100_000, 2000)
    cache.commit(lookup, 102_000)
    assert cache.counters.used == 102_000


def test_s9_29_concurrent_accesses_both_miss_until_commit() -> None:
    cache = AffinityKVCache(1000)
    first = cache.access("k", b"", 100)
    second = cache.access("k", b"", 100)
    assert not first.hit and not second.hit
    cache.commit(first, 100)
    cache.commit(second, 100)
    assert cache.access("k", b"", 100).hit


def test_s9_30_shorter_follow_up_never_shrinks_entry() -> None:
    cache = AffinityKVCache(200_000)
    request(cache, "k", 100_000)
    assert request(cache, "k", 50_000)[1] == 50_000
    assert request(cache, "k", 100_000)[1] == 100_000


def test_s9_31_lru_eviction_sequence() -> None:
    cache = AffinityKVCache(300)
    assert request(cache, "a", 100)[2:] == (0, 0)
    assert request(cache, "b", 100)[2:] == (0, 0)
    assert request(cache, "a", 100)[0]
    assert request(cache, "c", 150)[2:] == (1, 100)  # evicts b
    assert request(cache, "a", 100)[0]
    assert request(cache, "b", 100)[2:] == (1, 150)  # evicts c
    stats = cache.stats("m")
    assert (stats["kv_cache_eviction_count"], stats["kv_cache_evicted_tokens"]) == (2, 250)


def test_s9_33_no_key_or_no_capacity_is_a_counted_miss() -> None:
    for cache, key in ((AffinityKVCache(1000), None), (AffinityKVCache(0), "k")):
        lookup = cache.access(key, b"", 40)
        assert (lookup.hit, lookup.reused, lookup.uncached) == (False, 0, 40)
        cache.commit(lookup, 40)
        assert cache.entries == 0
        assert cache.counters.misses == 1


def test_s9_34_oversized_input_drops_existing_entry_as_one_eviction() -> None:
    cache = AffinityKVCache(1000)
    request(cache, "k", 600)
    assert request(cache, "k", 1500)[2:] == (1, 600)
    assert cache.entries == 0 and cache.counters.used == 0


def test_s9_35_stats_fields() -> None:
    stats = AffinityKVCache(10).stats("dummy-model")
    assert stats == {
        "model": "dummy-model", "kv_cache_capacity_tokens": 10, "kv_cache_used_tokens": 0,
        "kv_cache_free_tokens": 10, "kv_cache_entries": 0, "kv_cache_hit_count": 0,
        "kv_cache_miss_count": 0, "kv_cache_eviction_count": 0, "kv_cache_evicted_tokens": 0,
    }  # fmt: skip


def text(blocks: int, tag: str = "a", block_tokens: int = 4) -> bytes:
    return b"".join((f"{tag}{i:03d}" * 4)[: block_tokens * 4].encode() for i in range(blocks))


def test_prefix_longest_cached_prefix_counts() -> None:
    cache = PrefixKVCache(1000, block_tokens=4)
    prompt = text(5)
    first = cache.access(None, prompt, 20)
    assert not first.hit and len(first.blocks) == 5
    cache.commit(first, 20)
    follow_up = text(5) + text(2, "z")
    lookup = cache.access(None, follow_up, 28)
    assert (lookup.hit, lookup.reused, lookup.uncached) == (True, 20, 8)


def test_prefix_block_hash_depends_on_preceding_text() -> None:
    a = block_hashes(b"x" * 16 + b"y" * 16, 4)
    b = block_hashes(b"z" * 16 + b"y" * 16, 4)
    assert len(a) == 2 and a[1] != b[1]
    assert block_hashes(b"x" * 15, 4) == ()  # partial blocks are not cached


def test_prefix_in_flight_request_does_not_warm_cache() -> None:
    cache = PrefixKVCache(1000, block_tokens=4)
    first = cache.access(None, text(3), 12)
    second = cache.access(None, text(3), 12)
    assert not second.hit
    cache.commit(first, 12)
    assert cache.access(None, text(3), 12).reused == 12


def test_prefix_header_token_count_caps_reuse() -> None:
    cache = PrefixKVCache(1000, block_tokens=4)
    cache.commit(cache.access(None, text(5), 20), 20)
    assert cache.access(None, text(5), 8).reused == 8


def test_prefix_eviction_is_lru_by_block_and_keeps_own_blocks() -> None:
    cache = PrefixKVCache(16, block_tokens=4)  # 4 blocks
    cache.commit(cache.access(None, text(2, "a"), 8), 8)
    cache.commit(cache.access(None, text(2, "b"), 8), 8)
    lookup = cache.access(None, text(2, "a") + text(1, "c"), 12)  # refreshes a's blocks
    assert lookup.reused == 8
    eviction = cache.commit(lookup, 12)
    assert (eviction.entries, eviction.tokens) == (1, 4)
    assert cache.access(None, text(2, "a"), 8).reused == 8
    assert cache.access(None, text(2, "b"), 8).reused == 4  # b's leaf was evicted first
    stats = cache.stats("m")
    assert stats["kv_cache_entries"] == 4 and stats["kv_cache_used_tokens"] == 16


def test_prefix_disabled_with_zero_capacity() -> None:
    cache = PrefixKVCache(0, block_tokens=4)
    lookup = cache.access(None, text(3), 12)
    assert cache.commit(lookup, 12).entries == 0
    assert cache.access(None, text(3), 12).hit is False


def test_prefix_commit_of_the_computed_part_caches_its_full_blocks() -> None:
    cache = PrefixKVCache(1000, block_tokens=4)
    first = cache.access(None, text(5), 20)
    cache.commit(first, 20, computed=11)  # two full blocks of five computed
    assert cache.access(None, text(5), 20).reused == 8
    cache.commit(first, 20, computed=20)
    assert cache.access(None, text(5), 20).reused == 20


def test_prefix_partial_commit_follows_the_header_token_count() -> None:
    cache = PrefixKVCache(1000, block_tokens=4)
    first = cache.access(None, text(4), 1000)  # 4 blocks of text stand for 1000 tokens
    cache.commit(first, 1000, computed=500)
    assert len(cache.access(None, text(4), 1000).blocks) == 4
    assert cache.entries == 2


def test_affinity_commit_of_the_computed_part_retains_that_much() -> None:
    cache = AffinityKVCache(1000)
    lookup = cache.access("k", b"", 100)
    cache.commit(lookup, 100, computed=40)
    assert cache.access("k", b"", 100).reused == 40
    cache.commit(lookup, 100, computed=500)  # never past the prompt
    assert cache.counters.used == 100
