"""The algorithm registry: one spec per algorithm, tables derived from it, every check at load time."""

from __future__ import annotations

import pytest

from stargate.balancer.config import parse_lb_config
from stargate.balancer.registry import ALIASES, SPECS, build_policy, check_definition, default_definition
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Comparator
from stargate.errors import ConfigError

# One value of each JSON shape, with the edges of the ranges the checks enforce.
PROBE_VALUES = (None, True, 0, 1, 64, 65, 2**64, -1, 0.0, 0.5, 1.0, 1.5, -0.1, "ttft", "utilization", "s")


def test_every_algorithm_is_declared_once_in_enum_order() -> None:
    assert list(SPECS) == list(Algorithm)
    assert all(spec.algorithm is algorithm for algorithm, spec in SPECS.items())


def test_aliases_are_derived_and_never_shared() -> None:
    declared = [alias for spec in SPECS.values() for alias in spec.aliases]
    assert len(set(declared)) == len(declared)
    assert len(ALIASES) == len(SPECS) + len(declared)
    assert ALIASES["groq-multiregion"] is Algorithm.WAIT_AND_WIDEN
    assert all(ALIASES[a.value] is a for a in Algorithm)


def test_comparator_default_follows_the_flag() -> None:
    defaults = {a: default_definition(a).comparator for a in Algorithm}
    assert {a for a, c in defaults.items() if c is Comparator.TTFT} == {
        Algorithm.POWER_OF_N,
        Algorithm.WAIT_AND_WIDEN,
    }
    assert all(c in (None, Comparator.TTFT) for c in defaults.values())


@pytest.mark.parametrize("algorithm", list(Algorithm), ids=str)
def test_default_definitions_pass_the_checks(algorithm: Algorithm) -> None:
    check_definition(default_definition(algorithm), "$")


@pytest.mark.parametrize("algorithm", list(Algorithm), ids=str)
def test_a_config_that_loads_always_builds(algorithm: Algorithm) -> None:
    """Whatever the parser accepts, building its policy (lazily, on a first request) cannot fail."""
    accepted = 0
    for field in SPECS[algorithm].fields.model_fields:
        for value in PROBE_VALUES:
            try:
                config = parse_lb_config({"models": {"m": {"algorithm": algorithm.value, field: value}}})
            except ConfigError:
                continue
            accepted += 1
            for definition in config.definitions():
                build_policy(definition)
    assert accepted > 0


@pytest.mark.parametrize(
    ("entry", "field", "reason"),
    [
        ({"algorithm": "power-of-n", "sample_count": 0}, "sample_count", "between 1 and 64, got 0"),
        ({"algorithm": "pulsar-wait-and-widen", "comparator": "ttft"}, "comparator", "not supported"),
        ({"algorithm": "pulsar-wait-and-widen", "cache_affinity_wait_ms": 5},
         "cache_affinity_wait_ms", "only 0"),
        ({"algorithm": "wait-and-widen", "cache_affinity_input_tokens_scale": 2.0},
         "cache_affinity_input_tokens_scale", "between 0.0 and 1.0"),
        ({"algorithm": "wait-and-widen", "cache_affinity_virtual_nodes": 1001},
         "cache_affinity_virtual_nodes", "at most 1000, got 1001"),
    ],
)
def test_checks_run_at_load_and_name_the_json_path(entry: dict[str, object], field: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_lb_config({"models": {"m": entry}})
    assert info.value.path == f"$.models.m.{field}"
    assert reason in info.value.reason


@pytest.mark.parametrize(
    ("definition", "reason"),
    [
        (AlgorithmDefinition(Algorithm.RANDOM, seed="s"), "seed is not supported for random"),
        (AlgorithmDefinition(Algorithm.ROUND_ROBIN, comparator=Comparator.TTFT), "comparator is not"),
        (
            AlgorithmDefinition(Algorithm.POWER_OF_N, consider_kv_free_tokens=True),
            "consider_kv_free_tokens is supported only for pulsar and pulsar-wait-and-widen",
        ),
    ],
)
def test_definitions_built_in_code_are_checked_by_flags(definition: AlgorithmDefinition, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        build_policy(definition)
