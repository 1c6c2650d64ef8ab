from __future__ import annotations

import random
from collections import Counter

import pytest
from support.balancer_builders import chosen, chosen_id, make_candidate, make_request, rng

from stargate.balancer import Algorithm, AlgorithmDefinition, Unavailable, build_policy
from stargate.errors import ConfigError


def _ids(count: int) -> tuple:
    return tuple(make_candidate(f"c{i}") for i in range(count))


def _sequence(policy, candidates, steps: int, **request) -> list[str]:
    return [
        chosen_id(candidates, policy.decide(candidates, make_request(**request), rng())) for _ in range(steps)
    ]


def test_b76_alternates_and_a_fresh_instance_restarts() -> None:
    definition = AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    candidates = _ids(2)
    assert _sequence(build_policy(definition), candidates, 3) == ["c0", "c1", "c0"]
    assert _sequence(build_policy(definition), candidates, 1) == ["c0"]


def test_b77_instances_are_independent() -> None:
    definition = AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    first, second = build_policy(definition), build_policy(definition)
    candidates = _ids(3)
    assert _sequence(first, candidates, 2) == ["c0", "c1"]
    assert _sequence(second, candidates, 1) == ["c0"]
    assert _sequence(first, candidates, 1) == ["c2"]


def test_b78_exclusions_keep_list_order() -> None:
    policy = build_policy(AlgorithmDefinition(Algorithm.ROUND_ROBIN))
    assert _sequence(policy, _ids(4), 6, excluded={"c2"}) == ["c0", "c1", "c3", "c0", "c1", "c3"]
    policy = build_policy(AlgorithmDefinition(Algorithm.ROUND_ROBIN))
    assert _sequence(policy, _ids(5), 4, excluded={"c1", "c3"}) == ["c0", "c2", "c4", "c0"]


def test_b79_one_counter_per_instance_whoever_calls() -> None:
    # A header override that matches the configured algorithm reuses the configured instance.
    policy = build_policy(AlgorithmDefinition(Algorithm.ROUND_ROBIN))
    candidates = _ids(2)
    header_less = _sequence(policy, candidates, 1)
    with_header = _sequence(policy, candidates, 1)
    assert header_less + with_header + _sequence(policy, candidates, 1) == ["c0", "c1", "c0"]


def test_round_robin_does_not_advance_without_a_pick() -> None:
    policy = build_policy(AlgorithmDefinition(Algorithm.ROUND_ROBIN))
    candidates = _ids(2)
    assert _sequence(policy, candidates, 1) == ["c0"]
    assert isinstance(policy.decide(candidates, make_request(excluded={"c0", "c1"}), rng()), Unavailable)
    assert isinstance(policy.decide((), make_request(), rng()), Unavailable)
    assert _sequence(policy, candidates, 1) == ["c1"]


def test_b80_random_uses_every_cluster_and_never_an_excluded_one() -> None:
    policy = build_policy(AlgorithmDefinition(Algorithm.RANDOM))
    candidates = _ids(3)
    random_source = random.Random(80)
    used = {
        chosen_id(candidates, policy.decide(candidates, make_request(), random_source)) for _ in range(30)
    }
    assert used == {"c0", "c1", "c2"}
    for excluded in ({"c1"}, {"c0", "c2"}):
        picks = {
            chosen_id(candidates, policy.decide(candidates, make_request(excluded=excluded), random_source))
            for _ in range(60)
        }
        assert picks == {"c0", "c1", "c2"} - excluded


def test_random_rejection_path_with_few_exclusions_is_uniform() -> None:
    policy = build_policy(AlgorithmDefinition(Algorithm.RANDOM))
    candidates = _ids(8)
    random_source = random.Random(8)
    counts = Counter(
        chosen(policy.decide(candidates, make_request(excluded={"c3", "c5"}), random_source)).index
        for _ in range(6000)
    )
    assert set(counts) == {0, 1, 2, 4, 6, 7}
    assert all(abs(count / 6000 - 1 / 6) < 0.03 for count in counts.values())


def test_random_all_excluded_or_empty() -> None:
    policy = build_policy(AlgorithmDefinition(Algorithm.RANDOM))
    assert isinstance(policy.decide(_ids(2), make_request(excluded={"c0", "c1"}), rng()), Unavailable)
    assert isinstance(policy.decide((), make_request(), rng()), Unavailable)


@pytest.mark.parametrize("algorithm", [Algorithm.ROUND_ROBIN, Algorithm.RANDOM, Algorithm.POWER_OF_N])
def test_seed_is_rejected_for_unseeded_algorithms(algorithm: Algorithm) -> None:
    with pytest.raises(ConfigError, match=f"seed is not supported for {algorithm}"):
        build_policy(AlgorithmDefinition(algorithm, seed="x"))
