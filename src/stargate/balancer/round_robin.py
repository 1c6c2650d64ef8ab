"""``round-robin`` (spec §3.7): one counter per policy instance, advanced once per successful pick."""

from __future__ import annotations

import random

from stargate.balancer.algorithm_spec import AlgorithmSpec
from stargate.balancer.config_schema import RoundRobinFields
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import UNAVAILABLE, Candidate, Choice, Decision, LbRequest, Selected


class RoundRobin:
    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        self._counter = 0

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        excluded = request.excluded
        if not excluded:
            if not candidates:
                return UNAVAILABLE
            index = self._counter % len(candidates)
        else:
            eligible = [i for i, c in enumerate(candidates) if c.cluster_id not in excluded]
            if not eligible:
                return UNAVAILABLE
            index = eligible[self._counter % len(eligible)]
        self._counter += 1
        return Selected(Choice(index))


SPEC = AlgorithmSpec(Algorithm.ROUND_ROBIN, build=RoundRobin, fields=RoundRobinFields)
