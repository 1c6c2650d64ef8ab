"""Input-work admission (spec §3.9): reject when the target's pending prefill work exceeds a limit.

Checked by the proxy on every routing attempt before the policy runs. Work is counted in raw
stats as Pylon counts it (``Candidate.checked_stats``; the free-slot rule does not apply) and in
seconds of the admission candidates' summed input throughput.
"""

from __future__ import annotations

import math
from enum import StrEnum

from stargate.balancer.pulsar import Feasibility, feasibility
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.balancer.types import Candidate, LbRequest, valid_tps

_PULSAR_FAMILY = (Algorithm.PULSAR, Algorithm.PULSAR_WAIT_AND_WIDEN)


class AdmissionRejection(StrEnum):
    INPUT_WORK_LIMIT_EXCEEDED = "input_work_limit_exceeded"
    INPUT_WORK_CAPACITY_UNAVAILABLE = "input_work_capacity_unavailable"


def input_work_seconds(
    definition: AlgorithmDefinition, candidates: tuple[Candidate, ...], request: LbRequest
) -> float | None:
    """Seconds to process the request plus all queued input on the admission candidates."""
    excluded = request.excluded
    pulsar_family = definition.algorithm in _PULSAR_FAMILY
    consider_kv = definition.consider_kv_free_tokens
    pending = request.input_tokens
    rate = 0.0
    for candidate in candidates:
        stats = candidate.checked_stats
        tps = stats.last_mean_input_tps
        if pulsar_family:
            if not valid_tps(tps) or feasibility(candidate, request, consider_kv) is not Feasibility.ELIGIBLE:
                continue
        elif candidate.cluster_id in excluded:
            continue
        pending += stats.queued_input_size
        if valid_tps(tps):
            rate += tps
    if not (rate > 0.0 and math.isfinite(rate)):
        return None
    seconds = pending / rate
    return seconds if math.isfinite(seconds) else None


def check_admission(
    definition: AlgorithmDefinition, candidates: tuple[Candidate, ...], request: LbRequest
) -> AdmissionRejection | None:
    """None admits: also when no limit is configured or every candidate is retry-excluded."""
    limit = definition.max_input_work_seconds
    if limit is None:
        return None
    excluded = request.excluded
    if all(candidate.cluster_id in excluded for candidate in candidates):
        return None
    seconds = input_work_seconds(definition, candidates, request)
    if seconds is None:
        return AdmissionRejection.INPUT_WORK_CAPACITY_UNAVAILABLE
    if seconds > limit:
        return AdmissionRejection.INPUT_WORK_LIMIT_EXCEEDED
    return None
