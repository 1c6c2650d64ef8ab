"""One registry from canonical algorithm to policy class; every call builds a fresh instance."""

from __future__ import annotations

from collections.abc import Callable

from stargate.balancer.power_of_n import PowerOfN
from stargate.balancer.pulsar import Pulsar
from stargate.balancer.pulsar_wait_and_widen import PulsarWaitAndWiden
from stargate.balancer.random_choice import RandomChoice
from stargate.balancer.round_robin import RoundRobin
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Policy
from stargate.balancer.wait_and_widen import WaitAndWiden
from stargate.errors import ConfigError

POLICIES: dict[Algorithm, Callable[[AlgorithmDefinition], Policy]] = {
    Algorithm.POWER_OF_N: PowerOfN,
    Algorithm.WAIT_AND_WIDEN: WaitAndWiden,
    Algorithm.ROUND_ROBIN: RoundRobin,
    Algorithm.RANDOM: RandomChoice,
    Algorithm.PULSAR: Pulsar,
    Algorithm.PULSAR_WAIT_AND_WIDEN: PulsarWaitAndWiden,
}

_SEEDED = (Algorithm.WAIT_AND_WIDEN, Algorithm.PULSAR, Algorithm.PULSAR_WAIT_AND_WIDEN)
_KV_AWARE = (Algorithm.PULSAR, Algorithm.PULSAR_WAIT_AND_WIDEN)


def build_policy(definition: AlgorithmDefinition) -> Policy:
    """A new policy instance (own counters and caches); invalid settings raise ``ConfigError``."""
    algorithm = definition.algorithm
    if definition.seed and algorithm not in _SEEDED:
        raise ConfigError(f"seed is not supported for {algorithm}")
    if definition.consider_kv_free_tokens and algorithm not in _KV_AWARE:
        raise ConfigError("consider_kv_free_tokens is supported only for pulsar and pulsar-wait-and-widen")
    return POLICIES[algorithm](definition)
