"""``pulsar-wait-and-widen`` (spec §3.6): wait-and-widen over widening bands of a Pulsar ranking.

Without a queue SLO a feasible Pulsar primary is taken at once, whatever its load. Otherwise bands
``[0,1)``, ``[1,3)``, ``[3,7)``, … of the ranking are tried in order; inside a band wait-and-widen
picks among the feasible members by least queue time. The first band with a choice wins and
reports the chosen cluster's Pulsar rank as ``rank_depth``.

When no band can select but some band has a bucket locked only by time, the decision is
``Wait`` for the earliest such unlock (like plain wait-and-widen); otherwise ``Unavailable``.
"""

from __future__ import annotations

import random

from stargate.balancer.algorithm_spec import AlgorithmSpec, Problem
from stargate.balancer.config_schema import PulsarWaitAndWidenFields
from stargate.balancer.pulsar import Feasibility, PulsarRanker, feasibility
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import UNAVAILABLE, Candidate, Choice, Decision, LbRequest, Selected, Wait
from stargate.balancer.wait_and_widen import Ranking, WawSelector, check_affinity_settings


class PulsarWaitAndWiden:
    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        self._ranker = PulsarRanker(definition.seed)
        self._selector = WawSelector(definition, Ranking.LEAST_QUEUE)
        self._consider_kv = definition.consider_kv_free_tokens

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        if not candidates:
            return UNAVAILABLE
        ranking = self._ranker.ranking(candidates, request)
        if not ranking:
            return UNAVAILABLE
        consider_kv = self._consider_kv
        selector = self._selector
        primary = ranking[0]
        if selector.queue_slo is None and feasibility(candidates[primary], request, consider_kv).eligible:
            return Selected(Choice(primary))
        queue_limit = selector.queue_limit_ms(request)
        elapsed = request.elapsed_ms
        first_kv_skip = len(ranking)
        hint: float | None = None
        start, width = 0, 1
        while start < len(ranking):
            members: list[int] = []
            rank_of: dict[int, int] = {}
            for position in range(start, min(start + width, len(ranking))):
                index = ranking[position]
                verdict = feasibility(candidates[index], request, consider_kv)
                if verdict is Feasibility.ELIGIBLE:
                    members.append(index)
                    rank_of[index] = position
                elif verdict.kv_skip:
                    first_kv_skip = min(first_kv_skip, position)
            if members:
                result = selector.phase(candidates, members, request, 1.0, elapsed, queue_limit, rng)
                if isinstance(result, Choice):
                    position = rank_of[result.index]
                    return Selected(Choice(result.index, position + 1, first_kv_skip < position))
                if result is not None:
                    hint = result if hint is None else min(hint, result)
            start += width
            width = 2 if start == 1 else width * 2
        return UNAVAILABLE if hint is None else Wait(hint)


def _check(definition: AlgorithmDefinition) -> Problem | None:
    """The affinity wait of wait-and-widen is not part of this algorithm: only its defaults pass."""
    problem = check_affinity_settings(definition)
    if problem is not None:
        return problem
    wait_ms, scale = definition.cache_affinity_wait_ms, definition.cache_affinity_input_tokens_scale
    if wait_ms != 0:
        return (
            "cache_affinity_wait_ms",
            f"cache_affinity_wait_ms is not supported for pulsar-wait-and-widen (only 0), got {wait_ms}",
        )
    if scale != 1.0:
        return (
            "cache_affinity_input_tokens_scale",
            f"cache_affinity_input_tokens_scale is not supported for pulsar-wait-and-widen (only 1.0), "
            f"got {scale!r}",
        )
    return None


SPEC = AlgorithmSpec(
    Algorithm.PULSAR_WAIT_AND_WIDEN,
    build=PulsarWaitAndWiden,
    fields=PulsarWaitAndWidenFields,
    aliases=("pulsar-multiregion",),
    seeded=True,
    kv_aware=True,
    check=_check,
)
