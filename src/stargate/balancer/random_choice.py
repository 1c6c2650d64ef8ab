"""``random`` (spec §3.8): a uniform cluster; rejection sampling while few clusters are excluded."""

from __future__ import annotations

import random

from stargate.balancer.algorithm_spec import AlgorithmSpec
from stargate.balancer.config_schema import RandomFields
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import UNAVAILABLE, Candidate, Choice, Decision, LbRequest, Selected

_MAX_REJECTION_DRAWS = 8


class RandomChoice:
    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        total = len(candidates)
        if total == 0:
            return UNAVAILABLE
        excluded = request.excluded
        if not excluded:
            return Selected(Choice(int(rng.random() * total)))
        if len(excluded) <= total // 4:
            for _ in range(_MAX_REJECTION_DRAWS):
                index = int(rng.random() * total)
                if candidates[index].cluster_id not in excluded:
                    return Selected(Choice(index))
        eligible = [i for i, c in enumerate(candidates) if c.cluster_id not in excluded]
        if not eligible:
            return UNAVAILABLE
        return Selected(Choice(eligible[int(rng.random() * len(eligible))]))


SPEC = AlgorithmSpec(Algorithm.RANDOM, build=RandomChoice, fields=RandomFields)
