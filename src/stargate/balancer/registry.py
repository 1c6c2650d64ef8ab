"""The algorithm registry: every table about algorithms is derived here from the policy modules' specs.

A definition is checked once against its spec by :func:`check_definition`: the lb-config parser
does it when the file is loaded (so a bad setting is a startup error naming the JSON path) and
:func:`build_policy` does it again for definitions built in code.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from stargate.balancer import (
    power_of_n,
    pulsar,
    pulsar_wait_and_widen,
    random_choice,
    round_robin,
    wait_and_widen,
)
from stargate.balancer.algorithm_spec import AlgorithmSpec, Problem
from stargate.balancer.config_schema import child_path
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Comparator, Policy
from stargate.errors import ConfigError

_DECLARED = (
    power_of_n.SPEC,
    wait_and_widen.SPEC,
    round_robin.SPEC,
    random_choice.SPEC,
    pulsar.SPEC,
    pulsar_wait_and_widen.SPEC,
)

SPECS: Mapping[Algorithm, AlgorithmSpec] = MappingProxyType(
    {algorithm: spec for algorithm in Algorithm for spec in _DECLARED if spec.algorithm is algorithm}
)
"""Canonical algorithm → its spec, in the order of :class:`Algorithm`."""

ALIASES: Mapping[str, Algorithm] = MappingProxyType(
    {
        **{algorithm.value: algorithm for algorithm in SPECS},
        **{alias: spec.algorithm for spec in SPECS.values() for alias in spec.aliases},
    }
)
"""Every accepted JSON spelling of an algorithm name (exact, case-sensitive, spec §2.3)."""

_KV_AWARE_NAMES = " and ".join(spec.algorithm.value for spec in SPECS.values() if spec.kv_aware)


def default_definition(algorithm: Algorithm) -> AlgorithmDefinition:
    """A fresh definition with default settings (comparator resolved per §2.7)."""
    return AlgorithmDefinition(algorithm=algorithm, comparator=default_comparator(algorithm))


def default_comparator(algorithm: Algorithm) -> Comparator | None:
    return Comparator.TTFT if SPECS[algorithm].comparator else None


def problem(definition: AlgorithmDefinition) -> Problem | None:
    """The first setting ``definition``'s algorithm does not take or accept, else None."""
    spec = SPECS[definition.algorithm]
    name = spec.algorithm.value
    if definition.comparator is not None and not spec.comparator:
        return "comparator", f"comparator is not supported for {name}"
    if definition.seed and not spec.seeded:
        return "seed", f"seed is not supported for {name}"
    if definition.consider_kv_free_tokens and not spec.kv_aware:
        return "consider_kv_free_tokens", f"consider_kv_free_tokens is supported only for {_KV_AWARE_NAMES}"
    return spec.check(definition)


def check_definition(definition: AlgorithmDefinition, path: str = "") -> None:
    """Raise ``ConfigError`` naming the field under ``path`` when ``definition`` is not valid."""
    found = problem(definition)
    if found is not None:
        field, reason = found
        raise ConfigError(reason, path=child_path(path, field) if path else "")


def build_policy(definition: AlgorithmDefinition) -> Policy:
    """A new policy instance (own counters and caches); invalid settings raise ``ConfigError``."""
    check_definition(definition)
    return SPECS[definition.algorithm].build(definition)
