"""What a policy module declares about its algorithm; :mod:`stargate.balancer.registry` derives every
table (aliases, schemas, comparator defaults, constructors, supported settings) from these declarations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stargate.balancer.config_schema import Fields
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Policy, PrefillRate

Problem = tuple[str, str]
"""A definition problem: the JSON field at fault and the reason, as the config error reports them."""


def no_problem(definition: AlgorithmDefinition) -> Problem | None:
    return None


def check_prefill_rate(definition: AlgorithmDefinition) -> Problem | None:
    """``prefill_rate`` is an input of the load-aware estimates and means nothing without them."""
    if definition.prefill_rate is PrefillRate.MEASURED and not definition.load_aware:
        reason = 'prefill_rate "measured" is read by the load-aware estimates: set load_aware to true'
        return "prefill_rate", reason
    return None


@dataclass(frozen=True, slots=True)
class AlgorithmSpec:
    """One algorithm, declared once in its policy module.

    ``fields`` is the strict schema of a detailed `lb-config.json` entry; ``build`` makes a fresh
    policy; ``check`` finds what the schema cannot see (ranges, settings the algorithm ignores).
    The flags say which shared settings the algorithm takes: ``comparator`` (absent means ``ttft``,
    spec §2.7), ``seed`` and ``consider_kv_free_tokens``.
    """

    algorithm: Algorithm
    build: Callable[[AlgorithmDefinition], Policy]
    fields: type[Fields]
    aliases: tuple[str, ...] = ()
    comparator: bool = False
    seeded: bool = False
    kv_aware: bool = False
    check: Callable[[AlgorithmDefinition], Problem | None] = no_problem
