"""Weighted rendezvous hashing for Pulsar (spec §3.5).

Each cluster scores ``w / -ln(u)`` where ``w`` is its input throughput and ``u`` a uniform draw in
(0, 1) derived from the key's XXH3 hash; the highest score wins. The ranking depends only on the
key, the cluster ids and their throughputs, never on transient load.
"""

from __future__ import annotations

import math

import xxhash

from stargate.balancer.ring import tagged
from stargate.balancer.types import Candidate, valid_tps
from stargate.wire.limits import U64_MAX

_xxh3 = xxhash.xxh3_64_intdigest
# float(U64_MAX) + 2.0 rounds to exactly 2**64 in IEEE doubles, as the reference does.
_DENOMINATOR = float(U64_MAX) + 2.0


def rendezvous_base(prefix: bytes, cache_affinity_key: str | None) -> bytes:
    return prefix + tagged(b"cache_affinity_key", (cache_affinity_key or "").encode())


def rendezvous_hash(base: bytes, cluster_id: str) -> int:
    return _xxh3(base + tagged(b"cluster_id", cluster_id.encode()))


def rendezvous_score(hash_value: int, weight: float) -> float | None:
    """``weight / -ln(u)``; None when the weight is invalid or the draw degenerates."""
    if not valid_tps(weight):
        return None
    exponent = -math.log((float(hash_value) + 1.0) / _DENOMINATOR)
    if not (exponent > 0.0 and math.isfinite(exponent)):
        return None
    return weight / exponent


def rank(base: bytes, candidates: tuple[Candidate, ...]) -> tuple[int, ...]:
    """Candidate indices by score descending, ties by cluster id; unrankable candidates are left out."""
    scored: list[tuple[float, str, int]] = []
    for index, candidate in enumerate(candidates):
        cluster_id = candidate.cluster_id
        score = rendezvous_score(rendezvous_hash(base, cluster_id), candidate.stats.last_mean_input_tps)
        if score is not None:
            scored.append((-score, cluster_id, index))
    scored.sort()
    return tuple(entry[2] for entry in scored)
