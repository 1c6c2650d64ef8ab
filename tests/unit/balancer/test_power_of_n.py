from __future__ import annotations

import random
from collections import Counter

import pytest
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng

from stargate.balancer import Algorithm, AlgorithmDefinition, Comparator, Unavailable, build_policy
from stargate.balancer.power_of_n import PowerOfN
from stargate.errors import ConfigError


def _policy(sample_count: int = 2, comparator: Comparator = Comparator.TTFT) -> PowerOfN:
    policy = build_policy(
        AlgorithmDefinition(Algorithm.POWER_OF_N, sample_count=sample_count, comparator=comparator)
    )
    assert isinstance(policy, PowerOfN)
    return policy


def test_b30_only_the_eligible_candidate() -> None:
    candidates = tuple(make_candidate(f"c{i}", rtt_ms=float(i)) for i in range(3))
    policy, random_source = _policy(), rng()
    request = make_request(excluded={"c0", "c1"})
    assert {chosen_id(candidates, policy.decide(candidates, request, random_source)) for _ in range(50)} == {
        "c2"
    }


def test_b31_all_excluded_and_empty() -> None:
    candidates = (make_candidate("a"), make_candidate("b"))
    policy = _policy()
    assert isinstance(policy.decide(candidates, make_request(excluded={"a", "b"}), rng()), Unavailable)
    assert isinstance(policy.decide((), make_request(), rng()), Unavailable)


@pytest.mark.parametrize("sample_count", [3, 4, 64])
def test_b32_full_sample_picks_global_best(sample_count: int) -> None:
    candidates = (
        make_candidate("slow", rtt_ms=30.0),
        make_candidate("best", rtt_ms=2.0),
        make_candidate("mid", rtt_ms=9.0),
    )
    policy, random_source = _policy(sample_count), rng()
    assert {
        chosen_id(candidates, policy.decide(candidates, make_request(), random_source)) for _ in range(40)
    } == {"best"}


def test_b33_equal_scores_share_wins() -> None:
    candidates = tuple(make_candidate(f"c{i}") for i in range(3))
    policy, random_source = _policy(3), rng(3)
    picks = {chosen(policy.decide(candidates, make_request(), random_source)).index for _ in range(64)}
    assert picks == {0, 1, 2}


def test_b34_pair_inclusion_is_uniform() -> None:
    # With all scores equal every sampled candidate is equally likely to win, so inclusion in the
    # pair is measured through the private sampler directly.
    candidates = tuple(make_candidate(f"c{i}") for i in range(4))
    policy, random_source = _policy(2), random.Random(34)
    inclusion: Counter[int] = Counter()
    samples = 20_000
    for _ in range(samples):
        pair = policy._sample(candidates, frozenset(), random_source)
        assert len(set(pair)) == 2
        inclusion.update(pair)
    for index in range(4):
        assert abs(inclusion[index] / samples - 0.5) <= 0.04


def test_b34_excluded_sampling_is_uniform_over_eligible() -> None:
    candidates = tuple(make_candidate(f"c{i}") for i in range(5))
    policy, random_source = _policy(2), random.Random(5)
    inclusion: Counter[int] = Counter()
    for _ in range(8000):
        inclusion.update(policy._sample(candidates, frozenset({"c4"}), random_source))
    assert 4 not in inclusion
    for index in range(4):
        assert abs(inclusion[index] / 8000 - 0.5) <= 0.04


def test_b35_queue_free_backend_always_wins() -> None:
    candidates = (
        make_candidate("busy", tps=1000.0, queued=1000),
        make_candidate("free", tps=1000.0, queued=0),
    )
    policy, random_source = _policy(), rng()
    assert {
        chosen_id(candidates, policy.decide(candidates, make_request(input_tokens=10), random_source))
        for _ in range(50)
    } == {"free"}


def test_b36_shared_cluster_is_scored_on_summed_stats() -> None:
    # Two backends x (tps 100, 130 queued) aggregate to tps 200 / 260 queued: 1.3 s vs 1.2 s.
    candidates = (
        make_candidate("shared", tps=200.0, queued=260),
        make_candidate("single", tps=100.0, queued=120),
    )
    policy, random_source = _policy(), rng()
    assert {
        chosen_id(candidates, policy.decide(candidates, make_request(), random_source)) for _ in range(20)
    } == {"single"}
    drained = (make_candidate("shared", tps=200.0, queued=0), candidates[1])
    assert chosen_id(drained, policy.decide(drained, make_request(), random_source)) == "shared"


def test_single_sample_is_uniform_and_rank_one() -> None:
    candidates = tuple(make_candidate(f"c{i}", rtt_ms=float(i)) for i in range(4))
    policy, random_source = _policy(1), random.Random(11)
    counts = Counter(
        chosen(policy.decide(candidates, make_request(), random_source)).index for _ in range(4000)
    )
    assert all(abs(counts[i] / 4000 - 0.25) < 0.04 for i in range(4))
    assert chosen(policy.decide(candidates, make_request(), random_source)).rank_depth == 1


@pytest.mark.parametrize("sample_count", [0, 65])
def test_b5_sample_count_out_of_range(sample_count: int) -> None:
    with pytest.raises(
        ConfigError, match=f"power-of-n sample_count must be between 1 and 64, got {sample_count}"
    ):
        build_policy(AlgorithmDefinition(Algorithm.POWER_OF_N, sample_count=sample_count))
