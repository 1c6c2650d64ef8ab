"""Pylon publishes the cache-affinity keys it admitted (proto field 18), so every router replica
learns where the others sent a key, and the keys it is prefilling (field 19)."""

from __future__ import annotations

from stargate.pylon.load import Phase
from stargate.wire.headers import text_value
from stargate.wire.proto import MAX_AFFINITY_KEY_CHARS, MAX_AFFINITY_ROUTES, stats_from_proto, stats_to_proto

from .helpers import make_rig


def test_admitted_keys_are_published_for_the_window_then_dropped() -> None:
    rig = make_rig()
    start_ms = rig.clock.wall_ms()
    rig.hub.on_admitted(rig.gen, "session-1", 1200)
    rig.clock.advance(1.5)
    rig.hub.on_admitted(rig.gen, "session-2", 300)
    routes = rig.hub.snapshot(rig.gen).recent_cache_affinity_routes
    assert [(r.key, r.input_tokens, r.admitted_at_unix_ms) for r in routes] == [
        ("session-1", 1200, start_ms),
        ("session-2", 300, start_ms + 1500),
    ]
    rig.clock.advance(1.0)  # session-1 is now 2.5 s old: past the 2 s window (twice the heartbeat)
    assert [r.key for r in rig.hub.snapshot(rig.gen).recent_cache_affinity_routes] == ["session-2"]


def test_requests_without_a_key_or_with_one_the_router_does_not_read_publish_nothing() -> None:
    rig = make_rig()
    rig.hub.on_admitted(rig.gen, None, 10)
    rig.hub.on_admitted(rig.gen, "k" * (MAX_AFFINITY_KEY_CHARS + 1), 10)
    # The relay reads the header as the router does (text_value): visible ASCII, trimmed.
    for raw in (b"\xff\xfe".decode("utf-8", "surrogateescape"), "sessión-ü", " \t"):
        rig.hub.on_admitted(rig.gen, text_value(raw), 10)
    snap = rig.hub.snapshot(rig.gen)
    assert snap.recent_cache_affinity_routes == ()
    stats_to_proto(snap)  # the heartbeat stays buildable
    rig.hub.on_admitted(rig.gen, text_value(" session-7\t"), 10)
    assert [r.key for r in rig.hub.snapshot(rig.gen).recent_cache_affinity_routes] == ["session-7"]


def test_routes_are_bounded_newest_kept_and_survive_the_wire() -> None:
    rig = make_rig()
    for index in range(MAX_AFFINITY_ROUTES + 10):
        rig.hub.on_admitted(rig.gen, f"key-{index}", index)
    snap = rig.hub.snapshot(rig.gen)
    assert len(snap.recent_cache_affinity_routes) == MAX_AFFINITY_ROUTES
    assert snap.recent_cache_affinity_routes[0].key == "key-10"
    message = stats_to_proto(snap)
    assert message.recent_cache_affinity_routes[-1].cache_affinity_key == f"key-{MAX_AFFINITY_ROUTES + 9}"
    assert stats_from_proto(message).recent_cache_affinity_routes == snap.recent_cache_affinity_routes


def test_keys_before_their_first_byte_are_published_whichever_router_sent_them() -> None:
    rig = make_rig()

    def prefilling() -> frozenset[str]:
        return rig.hub.snapshot(rig.gen).prefilling_cache_affinity_keys

    rig.load.track("r1", rig.gen, 0, 6000, "agent-1")
    rig.load.track("r2", rig.gen, 0, 6000, "agent-1")
    rig.load.track("r3", rig.gen, 0, 10, None)
    assert prefilling() == {"agent-1"}
    rig.load.advance("r1", Phase.INPUT_PROCESSING)
    rig.load.advance("r1", Phase.OUTPUT_GENERATION)
    assert prefilling() == {"agent-1"}  # r2 still waits for its first byte
    rig.load.release("r2")
    assert prefilling() == frozenset()
    message = stats_to_proto(rig.hub.snapshot(rig.gen))
    assert list(message.prefilling_cache_affinity_keys) == []


def test_prefilling_keys_are_bounded_and_survive_the_wire() -> None:
    rig = make_rig()
    for index in range(MAX_AFFINITY_ROUTES + 10):
        rig.load.track(f"r{index}", rig.gen, 0, 10, f"key-{index}")
    rig.load.track("long", rig.gen, 0, 10, "k" * (MAX_AFFINITY_KEY_CHARS + 1))  # never published
    snap = rig.hub.snapshot(rig.gen)
    assert len(snap.prefilling_cache_affinity_keys) == MAX_AFFINITY_ROUTES
    assert stats_from_proto(stats_to_proto(snap)).prefilling_cache_affinity_keys == (
        snap.prefilling_cache_affinity_keys
    )
    message = stats_to_proto(snap)
    message.prefilling_cache_affinity_keys.extend(["", "k" * (MAX_AFFINITY_KEY_CHARS + 1)])
    del message.prefilling_cache_affinity_keys[: MAX_AFFINITY_ROUTES - 2]
    assert len(stats_from_proto(message).prefilling_cache_affinity_keys) == 2  # a router reads no junk
