"""Comparator scores (spec §3.2): lower wins, ``inf`` sorts last.

Each score reads the candidate snapshot as-is (reservations included, no staleness filter). The
queue-based scores use the effective queue delay (free-slot rule); the others use raw stats.
With ``load_aware`` every score reads the load-aware estimates instead (``estimates.load_*``), at
the measured prefill rate with ``prefill_rate: measured``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from stargate.balancer.estimates import (
    load_backlog,
    load_queue_ms,
    load_running,
    load_tps,
    load_ttft_ms,
    prefill_ms,
    queue_ms,
    usable_tps,
    work,
)
from stargate.balancer.settings import Comparator
from stargate.balancer.types import Candidate, valid_tps

Score = Callable[[Candidate, int, int], float]
"""``score(candidate, priority, input_tokens)``."""


def ttft_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    stats = candidate.stats
    return candidate.rtt_s * 1000.0 + queue_ms(stats, priority) + prefill_ms(stats, input_tokens)


def queue_time_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    return queue_ms(candidate.stats, priority)


def input_work_seconds_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    stats = candidate.stats
    return work(stats.queued_input_size + input_tokens, usable_tps(stats))


def utilization_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    stats = candidate.stats
    return stats.num_running_queries / max(stats.max_engine_concurrency, 1)


def num_requests_queued_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    return float(candidate.stats.queue_size)


SCORES: dict[Comparator, Score] = {
    Comparator.TTFT: ttft_score,
    Comparator.QUEUE_TIME: queue_time_score,
    Comparator.INPUT_WORK_SECONDS: input_work_seconds_score,
    Comparator.UTILIZATION: utilization_score,
    Comparator.NUM_REQUESTS_QUEUED: num_requests_queued_score,
}


def load_ttft_score(candidate: Candidate, priority: int, input_tokens: int, measured: bool = False) -> float:
    return load_ttft_ms(candidate, input_tokens, priority, measured=measured)


def load_queue_time_score(
    candidate: Candidate, priority: int, input_tokens: int, measured: bool = False
) -> float:
    return load_queue_ms(candidate, priority, measured)


def load_input_work_seconds_score(
    candidate: Candidate, priority: int, input_tokens: int, measured: bool = False
) -> float:
    tps = load_tps(candidate, measured)
    return work(load_backlog(candidate) + input_tokens, tps if valid_tps(tps) else 0.0)


def load_utilization_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    return load_running(candidate) / max(candidate.stats.max_engine_concurrency, 1)


def load_num_requests_queued_score(candidate: Candidate, priority: int, input_tokens: int) -> float:
    return float(max(candidate.stats.queue_size, candidate.in_flight.prefilling))


LOAD_SCORES: dict[Comparator, Score] = {
    Comparator.TTFT: load_ttft_score,
    Comparator.QUEUE_TIME: load_queue_time_score,
    Comparator.INPUT_WORK_SECONDS: load_input_work_seconds_score,
    Comparator.UTILIZATION: load_utilization_score,
    Comparator.NUM_REQUESTS_QUEUED: load_num_requests_queued_score,
}
"""The same comparators over the load-aware estimates: published stats merged with the router's own
in-flight count (max, never sum), no free-slot shortcut in the ranking."""


RATE_SCORES = (load_ttft_score, load_queue_time_score, load_input_work_seconds_score)
"""The load-aware scores that divide by a prefill rate."""


def score_for(comparator: Comparator | None, load_aware: bool = False, measured: bool = False) -> Score:
    """The score function of a comparator; an unset comparator means ``ttft`` (§2.7)."""
    score = (LOAD_SCORES if load_aware else SCORES)[comparator or Comparator.TTFT]
    if load_aware and measured and score in RATE_SCORES:
        return functools.partial(score, measured=True)
    return score
