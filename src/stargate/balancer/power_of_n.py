"""``power-of-n`` (spec §3.3): sample ``k`` clusters uniformly, keep the best by the comparator.

With ``load_aware`` the comparator reads the load-aware estimates and scores within
``ttft_bucket_size_ms`` of each other tie, broken by fewer requests running, then at random.
"""

from __future__ import annotations

import random

from stargate.balancer.algorithm_spec import AlgorithmSpec, Problem, check_prefill_rate
from stargate.balancer.comparators import score_for
from stargate.balancer.config_schema import PowerOfNFields
from stargate.balancer.estimates import load_running, load_tie_key
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Comparator, PrefillRate
from stargate.balancer.types import UNAVAILABLE, Candidate, Choice, Decision, LbRequest, Selected


class PowerOfN:
    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        measured = definition.prefill_rate is PrefillRate.MEASURED
        self._score = score_for(definition.comparator, definition.load_aware, measured)
        self._k = definition.sample_count
        self._load_aware = definition.load_aware
        # Only the millisecond scores have a resolution below which differences are noise.
        in_ms = (definition.comparator or Comparator.TTFT) in (Comparator.TTFT, Comparator.QUEUE_TIME)
        self._resolution = float(definition.ttft_bucket_size_ms) if in_ms else 0.0

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        sample = self._sample(candidates, request.excluded, rng)
        if not sample:
            return UNAVAILABLE
        score = self._score
        priority, tokens = request.priority, request.input_tokens
        if self._load_aware:
            return Selected(Choice(self._least_loaded(candidates, sample, priority, tokens, rng)))
        best = sample[0]
        best_score = score(candidates[best], priority, tokens)
        ties = 1
        for index in sample[1:]:
            value = score(candidates[index], priority, tokens)
            if value < best_score:
                best, best_score, ties = index, value, 1
            elif value == best_score:
                # Reservoir choice: the t-th equal score replaces the incumbent with probability 1/t.
                ties += 1
                if rng.random() * ties < 1.0:
                    best = index
        return Selected(Choice(best))

    def _least_loaded(
        self,
        candidates: tuple[Candidate, ...],
        sample: list[int],
        priority: int,
        tokens: int,
        rng: random.Random,
    ) -> int:
        """Best ``load_tie_key``; exact ties fall to a coin (reservoir), never to candidate order."""
        score, resolution = self._score, self._resolution
        best, best_key, ties = -1, None, 0
        for index in sample:
            candidate = candidates[index]
            key = load_tie_key(score(candidate, priority, tokens), load_running(candidate), resolution)
            if best_key is None or key < best_key:
                best, best_key, ties = index, key, 1
            elif key == best_key:
                ties += 1
                if rng.random() * ties < 1.0:
                    best = index
        return best

    def _sample(
        self, candidates: tuple[Candidate, ...], excluded: frozenset[str], rng: random.Random
    ) -> list[int]:
        total = len(candidates)
        if excluded:
            eligible = [i for i, c in enumerate(candidates) if c.cluster_id not in excluded]
            if len(eligible) <= self._k:
                return eligible
            return rng.sample(eligible, self._k)
        m = min(self._k, total)
        if m == 0:
            return []
        if m == total:
            return list(range(total))
        if m == 1:
            return [int(rng.random() * total)]
        if m == 2:
            a = int(rng.random() * total)
            b = int(rng.random() * (total - 1))
            return [a, b + 1 if b >= a else b]
        return rng.sample(range(total), m)


def _check(definition: AlgorithmDefinition) -> Problem | None:
    count = definition.sample_count
    if not 1 <= count <= 64:
        return "sample_count", f"power-of-n sample_count must be between 1 and 64, got {count}"
    return check_prefill_rate(definition)


SPEC = AlgorithmSpec(
    Algorithm.POWER_OF_N,
    build=PowerOfN,
    fields=PowerOfNFields,
    aliases=("power-of-two", "powerOf2", "powerOfN", "powerof2", "powerofn"),
    comparator=True,
    check=_check,
)
