from __future__ import annotations

import random

from support.balancer_builders import TARGET, chosen, chosen_id, make_candidate, make_request, rng

from stargate.balancer import Algorithm, AlgorithmDefinition, Selected, Unavailable, build_policy
from stargate.balancer.pulsar import PulsarRanker
from stargate.balancer.rendezvous import rank, rendezvous_base
from stargate.balancer.ring import hash_prefix
from stargate.balancer.types import Choice


def _pulsar(**settings: object) -> object:
    return build_policy(AlgorithmDefinition(Algorithm.PULSAR, seed="seed-1", **settings))  # type: ignore[arg-type]


def _abc(
    a: dict[str, object] | None = None, b: dict[str, object] | None = None, c: dict[str, object] | None = None
):
    # prefix-1 with equal tps ranks inst-b, inst-a, inst-c (Appendix A).
    return (
        make_candidate("inst-a", **(a or {})),  # type: ignore[arg-type]
        make_candidate("inst-b", **(b or {})),  # type: ignore[arg-type]
        make_candidate("inst-c", **(c or {})),  # type: ignore[arg-type]
    )


def test_b65_same_key_same_cluster_whatever_the_load() -> None:
    candidates = _abc({"tps": 1000.0}, {"tps": 700.0}, {"tps": 400.0})
    policy, random_source = _pulsar(), random.Random(65)
    picks = {
        chosen_id(candidates, policy.decide(candidates, make_request(key="prefix-1"), random_source))
        for _ in range(20)
    }  # type: ignore[attr-defined]
    assert picks == {"inst-a"}
    loaded = _abc(
        {"tps": 1000.0, "queued": 10**6, "running": 50, "max_concurrency": 1}, {"tps": 700.0}, {"tps": 400.0}
    )
    assert chosen_id(loaded, policy.decide(loaded, make_request(key="prefix-1"), random_source)) == "inst-a"  # type: ignore[attr-defined]


def test_b66_keys_spread_over_primaries() -> None:
    candidates = _abc()
    policy = _pulsar()
    primaries = {
        chosen_id(candidates, policy.decide(candidates, make_request(key=f"k{i}"), rng())) for i in range(128)
    }  # type: ignore[attr-defined]
    assert len(primaries) >= 2


def test_b67_only_valid_throughput_is_ranked() -> None:
    candidates = (
        make_candidate("zero", tps=0.0),
        make_candidate("one", tps=1.0),
        make_candidate("ten", tps=10.0),
    )
    ranking = PulsarRanker("seed-1").ranking(candidates, make_request(key="k"))
    assert sorted(candidates[i].cluster_id for i in ranking) == ["one", "ten"]
    invalid = (make_candidate("zero", tps=0.0), make_candidate("nan", tps=float("nan")))
    assert isinstance(_pulsar().decide(invalid, make_request(key="k"), rng()), Unavailable)  # type: ignore[attr-defined]


def test_b68_throughput_swap_moves_primary() -> None:
    policy = _pulsar()
    before = (make_candidate("inst-a", tps=10_000.0), make_candidate("inst-b", tps=1.0))
    after = (make_candidate("inst-a", tps=1.0), make_candidate("inst-b", tps=10_000.0))
    assert chosen_id(before, policy.decide(before, make_request(key="prefix-1"), rng())) == "inst-a"  # type: ignore[attr-defined]
    assert chosen_id(after, policy.decide(after, make_request(key="prefix-1"), rng())) == "inst-b"  # type: ignore[attr-defined]


def test_b69_kv_ignored_by_default() -> None:
    candidates = _abc(b={"kv_free": 64, "kv_capacity": 1000})
    decision = _pulsar().decide(candidates, make_request(key="prefix-1", input_tokens=128), rng())  # type: ignore[attr-defined]
    assert decision == Selected(Choice(1, rank_depth=1))


def test_b70_kv_skip_to_second_rank() -> None:
    policy = _pulsar(consider_kv_free_tokens=True)
    for primary in ({"kv_free": 64, "kv_capacity": 1000}, {}):
        candidates = _abc(
            {"kv_free": 500, "kv_capacity": 1000}, primary, {"kv_free": 500, "kv_capacity": 1000}
        )
        decision = policy.decide(candidates, make_request(key="prefix-1", input_tokens=128), rng())  # type: ignore[attr-defined]
        assert decision == Selected(Choice(0, rank_depth=2, selected_after_kv_free_tokens_skip=True))


def test_b71_kv_is_rechecked_with_a_cached_ranking() -> None:
    policy = _pulsar(consider_kv_free_tokens=True)
    roomy = {"kv_free": 500, "kv_capacity": 1000}
    candidates = _abc(roomy, roomy, roomy)
    request = make_request(key="prefix-1", input_tokens=128)
    assert chosen_id(candidates, policy.decide(candidates, request, rng())) == "inst-b"  # type: ignore[attr-defined]
    drained = _abc(roomy, {"kv_free": 10, "kv_capacity": 1000}, roomy)
    assert chosen_id(drained, policy.decide(drained, request, rng())) == "inst-a"  # type: ignore[attr-defined]


def test_b72_excluded_primary_falls_back() -> None:
    candidates = _abc()
    policy = _pulsar()
    decision = policy.decide(candidates, make_request(key="prefix-1", excluded={"inst-b"}), rng())  # type: ignore[attr-defined]
    assert chosen_id(candidates, decision) == "inst-a" and chosen(decision).rank_depth == 2
    assert not chosen(decision).selected_after_kv_free_tokens_skip
    everything = {"inst-a", "inst-b", "inst-c"}
    assert isinstance(
        policy.decide(candidates, make_request(key="prefix-1", excluded=everything), rng()), Unavailable
    )  # type: ignore[attr-defined]
    assert isinstance(policy.decide((), make_request(key="prefix-1"), rng()), Unavailable)  # type: ignore[attr-defined]


def test_absent_key_equals_empty_key() -> None:
    candidates = _abc()
    policy = _pulsar()
    assert policy.decide(candidates, make_request(), rng()) == policy.decide(
        candidates, make_request(key=""), rng()
    )  # type: ignore[attr-defined]


def test_ranking_cache_is_transparent_and_bounded() -> None:
    ranker = PulsarRanker("seed-1")
    candidates = tuple(make_candidate(f"c{i}", tps=float(10 + i)) for i in range(6))
    base_prefix = hash_prefix("seed-1", TARGET)
    for round_ in range(2):
        for i in range(5000):
            key = f"key-{i % 4500}"
            assert ranker.ranking(candidates, make_request(key=key)) == rank(
                rendezvous_base(base_prefix, key), candidates
            )
        assert len(ranker._cache) <= 4096, round_
    long_key = "x" * 257
    ranker.ranking(candidates, make_request(key=long_key))
    assert ranker._cache.get(long_key) is None
    # A changed throughput or order invalidates cached indices.
    reordered = candidates[::-1]
    assert ranker.ranking(reordered, make_request(key="key-1")) == rank(
        rendezvous_base(base_prefix, "key-1"), reordered
    )
