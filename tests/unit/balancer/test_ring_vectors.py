"""Appendix A reference vectors: tagged byte layout, XXH3-64 hashes, ring walks and Pulsar scores."""

from __future__ import annotations

import pytest
from support.balancer_builders import make_candidate

from stargate.balancer import Target
from stargate.balancer.rendezvous import rank, rendezvous_base, rendezvous_hash, rendezvous_score
from stargate.balancer.ring import AffinityRing, hash_prefix, key_hash, tagged, virtual_node_hash

PREFIX = hash_prefix("seed-1", Target("rk-1", "model-a"))
AFFINITY = ("affinity-a", "affinity-b", "affinity-c")


def test_tagged_layout() -> None:
    assert tagged(b"seed", b"ab") == b"seed\xff\x02\x00\x00\x00\x00\x00\x00\x00ab"
    assert PREFIX.startswith(b"\x01seed\xff")


def test_b59_virtual_node_hash() -> None:
    assert virtual_node_hash(PREFIX, "inst-a", 7) == 0x81B29B2500D24E30


def test_b60_routing_keys_separate_rings() -> None:
    tenant_a = hash_prefix("seed-1", Target("tenant-a", "model-a"))
    tenant_b = hash_prefix("seed-1", Target("tenant-b", "model-a"))
    assert virtual_node_hash(tenant_a, "inst-a", 0) != virtual_node_hash(tenant_b, "inst-a", 0)
    assert hash_prefix("seed-2", Target("tenant-a", "model-a")) != tenant_a
    assert hash_prefix("seed-1", Target("tenant-a", "model-b")) != tenant_a


def test_key_hash_vector() -> None:
    assert key_hash(PREFIX, "prefix-a") == 0xB24F129F950557D2


@pytest.mark.parametrize(
    ("key", "count", "expected"),
    [
        ("prefix-a", 1, ["affinity-c"]),
        ("prefix-a", 2, ["affinity-c", "affinity-a"]),
        ("prefix-b", 1, ["affinity-b"]),
        ("prefix-b", 2, ["affinity-b", "affinity-c"]),
        ("prefix-b", 9, ["affinity-b", "affinity-c", "affinity-a"]),
    ],
)
def test_ring_selection_vectors(key: str, count: int, expected: list[str]) -> None:
    ring = AffinityRing(PREFIX, AFFINITY, 8)
    assert [AFFINITY[i] for i in ring.select(key, count)] == expected


def test_ring_selection_default_seed_and_no_routing_key() -> None:
    clusters = ("c1", "c2", "c3", "c4")
    ring = AffinityRing(hash_prefix("", Target(None, "model-a")), clusters, 150)
    assert [clusters[i] for i in ring.select("k", 2)] == ["c4", "c1"]


def test_ring_is_order_independent() -> None:
    forward = AffinityRing(PREFIX, AFFINITY, 8)
    backward = AffinityRing(PREFIX, AFFINITY[::-1], 8)
    for key in ("prefix-a", "prefix-b", "zzz"):
        assert [AFFINITY[i] for i in forward.select(key, 2)] == [
            AFFINITY[::-1][i] for i in backward.select(key, 2)
        ]


def test_b64_pulsar_pinned_hash() -> None:
    assert rendezvous_hash(rendezvous_base(PREFIX, "prefix-123"), "inst-a") == 0x19443C44EC9F8ABF


@pytest.mark.parametrize(
    ("weights", "scores", "order"),
    [
        ((100.0, 100.0, 100.0), (88.894, 117.495, 81.619), ["inst-b", "inst-a", "inst-c"]),
        ((1000.0, 700.0, 400.0), (888.94, 822.46, 326.48), ["inst-a", "inst-b", "inst-c"]),
    ],
)
def test_pulsar_ranking_vectors(
    weights: tuple[float, ...], scores: tuple[float, ...], order: list[str]
) -> None:
    base = rendezvous_base(PREFIX, "prefix-1")
    names = ("inst-a", "inst-b", "inst-c")
    for name, weight, score in zip(names, weights, scores, strict=True):
        assert rendezvous_score(rendezvous_hash(base, name), weight) == pytest.approx(score, abs=0.005)
    candidates = tuple(make_candidate(name, tps=weight) for name, weight in zip(names, weights, strict=True))
    assert [names[i] for i in rank(base, candidates)] == order


def test_degenerate_draws_are_not_ranked() -> None:
    assert rendezvous_score(2**64 - 1, 100.0) is None  # u rounds to 1, -ln(u) == 0
    assert rendezvous_score(0, 0.0) is None
    assert rendezvous_score(0, float("nan")) is None
