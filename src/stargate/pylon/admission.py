"""Local queue admission (spec pylon.md §8.1-§8.2, stargate.md §4.9).

Pylon's variant of the shared estimate: the same ``has_free_slot`` / ``queue_estimate`` rules of
``stargate.balancer.estimates``, evaluated on a stats view that excludes the incoming request's
own reservation (its slot and its prompt work), so a request never queues behind itself.

Not in the original: a request the router expected to start at once (an expected queue of 0) that
finds every slot taken also counts the wait for a slot (``estimates.slot_wait_ms`` at the engine's
measured slot time). The spec's snapshot math counts only prompt tokens waiting, so an engine whose
slots all hold answers being decoded looked free, and a request that another router's burst or a
canary had beaten to the last slot waited there for a whole answer while another engine had a free
slot. Where the router too expected a queue, both sides compare the prompt work, as in the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from stargate.balancer import estimates
from stargate.balancer.types import ModelStats, valid_tps
from stargate.pylon.load import LiveLoad
from stargate.pylon.models import Generation
from stargate.wire import headers as h
from stargate.wire.limits import U64_MAX


class Result(StrEnum):
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    MISSING_ESTIMATE = "missing_estimate"
    UNKNOWN_LOCAL_ESTIMATE = "unknown_local_estimate"
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = True
    min_delta_ms: int = 25
    tolerance_factor: float = 1.25
    retry_after_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    result: Result
    expected_ms: int | None = None
    actual_ms: int | None = None
    threshold_ms: int | None = None

    @property
    def rejected(self) -> bool:
        return self.result is Result.REJECTED


def threshold_ms(expected: int, min_delta: int, factor: float) -> int:
    """``max(expected + min_delta, ceil(expected · factor))`` saturating at u64 max."""
    if not (math.isfinite(factor) and factor > 0):
        factor = 1.0
    scaled = expected * factor
    scaled_ms = U64_MAX if not math.isfinite(scaled) or scaled >= U64_MAX else math.ceil(scaled)
    return min(max(expected + min_delta, scaled_ms), U64_MAX)


def parse_expected(raw: str | None) -> int | None:
    return h.optional_unsigned(raw, U64_MAX)


def local_view(
    load: LiveLoad, gen: Generation, request_id: str, *, input_tps: float, limit: int
) -> ModelStats | None:
    """Stats of ``gen`` as the incoming request sees them (its own reservation excluded).

    None when the generation has no queue state.
    """
    if not load.has_generation(gen):
        return None
    active = load.active_requests(gen, exclude_request_id=request_id)
    work = load.estimates(gen, input_tps, exclude_request_id=request_id) if valid_tps(input_tps) else None
    return ModelStats(
        last_mean_input_tps=input_tps,
        num_running_queries=active,
        max_engine_concurrency=limit,
        queue_time_estimate_ms_by_priority=MappingProxyType(work or {}),
    )


def decide(
    config: AdmissionConfig,
    expected_header: str | None,
    *,
    load: LiveLoad,
    gen: Generation,
    request_id: str,
    priority: int,
    input_tps: float,
    limit: int,
) -> Decision:
    if not config.enabled:
        return Decision(Result.DISABLED)
    expected = parse_expected(expected_header)
    if expected is None:
        return Decision(Result.MISSING_ESTIMATE)
    view = local_view(load, gen, request_id, input_tps=input_tps, limit=limit)
    if view is None:
        return Decision(Result.UNKNOWN_LOCAL_ESTIMATE, expected)
    if not estimates.has_free_slot(view) and not valid_tps(input_tps):
        return Decision(Result.UNKNOWN_LOCAL_ESTIMATE, expected)
    actual = estimates.effective_queue_ms(view, priority)
    if actual is None:
        return Decision(Result.UNKNOWN_LOCAL_ESTIMATE, expected)
    if expected == 0 and limit > 0 and not estimates.has_free_slot(view):
        wait = estimates.slot_wait_ms(load.slot_hold_s(gen), view.num_running_queries, limit)
        actual = min(U64_MAX, actual + math.ceil(wait))
    threshold = threshold_ms(expected, config.min_delta_ms, config.tolerance_factor)
    result = Result.REJECTED if actual > threshold else Result.ACCEPTED
    return Decision(result, expected, actual, threshold)
