"""Queue, prefill and TTFT estimates (spec §1.9, §1.12, §3.1), all in milliseconds.

Two queue notions exist. ``queue_estimate`` is the raw shared estimate of §1.12 (what a backend's
published stats say is waiting). ``effective_queue_ms`` applies the free-slot rule: a backend with a
known concurrency limit and a free slot starts the request at once, so its effective queue delay is
0. Every queue-based routing estimate and the ``x-stargate-expected-queue-ms`` header use the
effective value; input-work scores, utilization, capacity checks and admission use the raw stats.

The load-aware estimates (lb-config ``load_aware``) rank with the work in progress instead, merging
the published stats with the router's own in-flight count (``Candidate.in_flight``); the free-slot
rule stays the rule for admission, the queue-SLO filter and the expected-queue header. With
``prefill_rate: measured`` they divide by the router's own measure of the cluster's prefill rate
(``Candidate.measured_input_tps``) where it is above the published mean; admission and the header
keep the published one, which is what Pylon checks against. With ``prefill_sharing`` they model
an engine that shares its prefill rate between the prompts it prefills (``sharing_queue_ms``).
Likewise the ranking counts only the prompt work the router expects uncached, while admission, the
queue-SLO filter and the header count it as Pylon does (``Candidate.checked_stats``,
``InFlight.cached_tokens``).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from stargate.balancer.types import EMPTY_PRIORITY_MAP, Candidate, ModelStats, valid_tps
from stargate.wire.limits import U64_MAX, saturating_add

INF = math.inf


def work(amount: float, rate: float) -> float:
    """Time to process ``amount`` at ``rate``: no work is free even without capacity."""
    if amount == 0:
        return 0.0
    if rate <= 0.0:
        return INF
    return amount / rate


def usable_tps(stats: ModelStats) -> float:
    tps = stats.last_mean_input_tps
    return tps if valid_tps(tps) else 0.0


def floor_lookup(estimates: Mapping[int, int], priority: int) -> int | None:
    """Value at the greatest priority key ``<= priority`` (None when every key is less urgent)."""
    best: int | None = None
    for key in estimates:
        if key <= priority and (best is None or key > best):
            best = key
    return None if best is None else estimates[best]


def queue_estimate(stats: ModelStats, priority: int) -> int | None:
    """Raw shared queue-time estimate (§1.12); None when capacity is unknown or it overflows u64."""
    estimates = stats.queue_time_estimate_ms_by_priority
    if estimates:
        value = floor_lookup(estimates, priority)
        return 0 if value is None else value
    queued = stats.queued_input_size
    if queued == 0:
        return 0
    tps = stats.last_mean_input_tps
    if not valid_tps(tps):
        return None
    millis = queued / tps * 1000.0
    if not math.isfinite(millis) or millis > U64_MAX:
        return None
    result = math.ceil(millis)
    return result if result <= U64_MAX else None


def has_free_slot(stats: ModelStats) -> bool:
    """A known concurrency limit with room left: the next request starts without queueing."""
    limit = stats.max_engine_concurrency
    return limit > 0 and stats.num_running_queries < limit


def effective_queue_ms(stats: ModelStats, priority: int) -> int | None:
    """The queue estimate after the free-slot rule; the ``x-stargate-expected-queue-ms`` value."""
    if has_free_slot(stats):
        return 0
    return queue_estimate(stats, priority)


def expected_queue_ms(candidate: Candidate, priority: int, load_aware: bool = False) -> int | None:
    """The ``x-stargate-expected-queue-ms`` value: ``effective_queue_ms``. With ``load_aware`` the
    free-slot rule counts this router's own requests in flight too (``load_running``), and a
    backend without a free slot is expected to queue for ``load_queue_ms`` (at the published rate,
    Pylon's): the published stats see a request only from the heartbeat after it reached Pylon,
    and a burst routed in between was expected to start at once where Pylon, counting it, found
    every slot taken and rejected it. A backend known to be full is expected to queue at least
    1 ms: an expected 0 tells Pylon the request was sent for a free slot (``pylon.admission``).
    Prompts the router expects cached count whole where Pylon counts them whole: a lower
    expectation had Pylon reject a key's follow-up that then left its cache."""
    stats = candidate.checked_stats
    if not load_aware:
        return effective_queue_ms(stats, priority)
    own = candidate.in_flight
    if candidate.pylon_stats is not None or own.cached_tokens:
        own = replace(own, prefill_tokens=own.prefill_tokens + own.cached_tokens, cached_tokens=0)
        candidate = replace(candidate, stats=stats, in_flight=own, pylon_stats=None)
    queue, running, _ = load_queue_running_rate(candidate, priority)
    limit = stats.max_engine_concurrency
    if limit > 0 and running < limit:
        return 0
    if not math.isfinite(queue) or queue > U64_MAX:
        return effective_queue_ms(stats, priority)
    return max(1, math.ceil(queue))


def queue_ms(stats: ModelStats, priority: int) -> float:
    """Effective queue delay as a routing score: an unknown estimate with queued work is infinite.

    Equal to ``effective_queue_ms`` as a float where that is known; written flat because it runs
    once per candidate per decision.
    """
    limit = stats.max_engine_concurrency
    if limit > 0 and stats.num_running_queries < limit:
        return 0.0
    return raw_queue_ms(stats, priority)


def raw_queue_ms(stats: ModelStats, priority: int) -> float:
    """The §3.1 queue delay before the free-slot rule."""
    estimates = stats.queue_time_estimate_ms_by_priority
    if estimates:
        value = estimates.get(priority)
        if value is None:
            value = floor_lookup(estimates, priority)
        return 0.0 if value is None else float(value)
    queued = stats.queued_input_size
    if queued == 0:
        return 0.0
    tps = stats.last_mean_input_tps
    if not 0.0 < tps < INF:
        return INF
    millis = queued / tps * 1000.0
    # Past u64 the shared estimate is unknown and the raw work quotient is used instead.
    return float(math.ceil(millis)) if millis <= U64_MAX else millis


# ---- load-aware estimates (lb-config ``load_aware``) --------------------------------------------


def load_tps(candidate: Candidate, measured: bool) -> float:
    """The prefill rate the load-aware estimates divide by: with ``measured`` the larger of the
    router's own measure and the published mean, else the published mean.

    Both read low, for different reasons. The published mean is per-request samples, each a share
    of an engine that prefills several prompts at once (or a pinned, bootstrapped value). The
    router's measure counts the work it expected: a prompt the engine had to prefill again because
    its cache lost it reads as a slower engine, and so does the time another router's requests
    took. A low reading of the latter would make a missed cache look like load and drive keys off
    their caches; the larger of two low estimates is the closer one."""
    published = candidate.stats.last_mean_input_tps
    if measured:
        rate = candidate.measured_input_tps
        if rate > published:
            return rate
    if not 0.0 < published < INF and candidate.assumed_input_tps > 0.0:
        return candidate.assumed_input_tps
    return published


UNKNOWN_PREFILL_TPS = 1000.0
"""The prefill rate assumed for every cluster of a target when none publishes one (tokens/s, low
for a GPU): the order is then the prompt work ahead, whatever the value."""


def with_assumed_rates(candidates: tuple[Candidate, ...]) -> tuple[Candidate, ...]:
    """``candidates``, each cluster that publishes no prefill rate with an ``assumed_input_tps``:
    the mean of the others' published rates, or ``UNKNOWN_PREFILL_TPS`` when none has one.

    Pylon publishes 0 until it has measured a rate (no ``--initial-input-tps``, no calibration),
    and it measures one from the answers it relays. Taken for infinite, that prefill kept the
    cluster from every request that would have measured it, and a fleet of such clusters answered
    every request 503. Only the load-aware estimates read the assumed rate."""
    if all(0.0 < c.stats.last_mean_input_tps < INF for c in candidates):
        return candidates  # the usual case, on every rebuild: nothing built
    known = [tps for c in candidates if 0.0 < (tps := c.stats.last_mean_input_tps) < INF]
    rate = statistics.fmean(known) if known else UNKNOWN_PREFILL_TPS
    return tuple(
        c if 0.0 < c.stats.last_mean_input_tps < INF else replace(c, assumed_input_tps=rate)
        for c in candidates
    )


def load_running(candidate: Candidate) -> int:
    """Requests running on the cluster: the published count (with reservations) or this router's
    own in-flight count, whichever is larger. A max, never a sum: a request both reserved and
    counted by the engine is counted once."""
    published = candidate.stats.num_running_queries
    own = candidate.in_flight.requests
    return published if published >= own else own


def load_backlog(candidate: Candidate) -> int:
    """Prompt tokens waiting for their first byte: published (with reservations) or own, the larger."""
    published = candidate.stats.queued_input_size
    own = candidate.in_flight.prefill_tokens
    return published if published >= own else own


def load_queue_ms(candidate: Candidate, priority: int, measured: bool = False) -> float:
    """Queue delay that sees work in progress below the slot limit.

    A free slot is not a free engine: on a continuous-batching engine every request prefilling at
    once shares the prefill throughput, so a new request waits roughly for the prompt tokens ahead
    of it. Those are the published pending prompt tokens (reservations included) or this router's
    own tokens still before their first byte, whichever is larger. With no free slot the §3.1
    estimate (which may come from the engine's priority map) also applies; the larger wins. At a
    measured rate that estimate, time at the published rate, is converted to the measured one.
    """
    return load_queue_running_rate(candidate, priority, measured)[0]


def load_queue_running_rate(
    candidate: Candidate, priority: int, measured: bool = False
) -> tuple[float, int, float]:
    """``load_queue_ms``, ``load_running`` and ``load_tps`` in one flat pass (``load_backlog``
    inlined): wait-and-widen needs all three for every candidate of every decision."""
    stats = candidate.stats
    own = candidate.in_flight
    running = stats.num_running_queries
    if own.requests > running:
        running = own.requests
    backlog = stats.queued_input_size
    if own.prefill_tokens > backlog:
        backlog = own.prefill_tokens
    published = stats.last_mean_input_tps
    tps = load_tps(candidate, measured)
    queue = 0.0 if backlog == 0 else backlog * 1000.0 / tps if 0.0 < tps < INF else INF
    limit = stats.max_engine_concurrency
    if not (limit > 0 and running < limit):
        known = 0.0 < published < INF
        # Without a published rate the §3.1 estimate is the work ahead at none: infinite. The
        # backlog at the assumed rate (``with_assumed_rates``) already counts that work.
        spec = raw_queue_ms(stats, priority) if known or stats.queue_time_estimate_ms_by_priority else 0.0
        if tps != published and known:
            spec *= published / tps  # Pylon's estimate is time at the published rate
        if spec > queue:
            queue = spec
    return queue, running, tps


def load_ttft_ms(
    candidate: Candidate, input_tokens: int, priority: int, scale: float = 1.0, measured: bool = False
) -> float:
    """rtt + load-aware queue + the request's own (optionally cache-discounted) prefill."""
    return (
        candidate.rtt_s * 1000.0
        + load_queue_ms(candidate, priority, measured)
        + prefill_at(load_tps(candidate, measured), input_tokens, scale)
    )


def shared_prefill_tokens(candidate: Candidate, tokens: float) -> float:
    """Prompt work a prompt of ``tokens`` shares the cluster with, on an engine that splits its
    prefill rate equally between every prompt it prefills (processor sharing, lb-config
    ``prefill_sharing``): each prompt there takes ``min(its tokens, tokens)`` of the rate before
    the new one ends, so the new one waits that long, and each of them waits as long again.

    This router's prompts count with their sizes (their progress is not known: an upper bound).
    Prompts the published stats count beyond them before their first byte (``queue_size``, another
    router's) count with their published work (``queued_input_size``), each at most ``tokens``."""
    own = candidate.in_flight
    stats = candidate.stats
    others = stats.queue_size - own.prefilling
    sizes = own.prefill_sizes
    if tokens <= 0.0 or not (sizes or others > 0):
        return 0.0
    total = 0.0
    if sizes:
        cut = bisect.bisect_left(sizes, tokens)
        total = float(sum(sizes[:cut])) + tokens * (len(sizes) - cut)
    rest = stats.queued_input_size - own.prefill_tokens
    if others > 0 and rest > 0:
        total += min(float(rest), others * tokens)
    return total


def sharing_queue_ms(candidate: Candidate, tokens: float, tps: float, running: int, now: float) -> float:
    """The load-aware queue term with ``prefill_sharing``: the wait for a slot at the limit, then
    ``shared_prefill_tokens`` twice (the request's wait behind the prompts it shares the engine
    with, and theirs behind it) at ``tps``. Ranking by the fleet's wait, not the request's own,
    picks the engine where a prompt adds least; the work ahead is not a wait here, as it is on a
    first-come-first-served engine: a short prompt beside long ones ends first."""
    shared = shared_prefill_tokens(candidate, tokens)
    queue = 0.0 if shared == 0.0 else shared * 2000.0 / tps if 0.0 < tps < INF else INF
    limit = candidate.stats.max_engine_concurrency
    if 0 < limit <= running:
        queue += slot_wait_ms(slot_hold_s(candidate, now), running, limit)
    return queue


def slot_hold_s(candidate: Candidate, now: float) -> float:
    """How long a request holds a slot on the cluster: the router's measure, or before any of its
    requests there has ended, how long the oldest still running has held one. That bound grows
    while a burst that filled the engine runs: taking it for unknown (0) made a full engine look
    free until its first request ended. 0 when nothing is known."""
    measured = candidate.measured_slot_s
    if measured > 0.0:
        return measured
    since = candidate.slot_held_since
    return now - since if since < now else 0.0


SLOT_SAMPLES = 32
"""The measured slot time is the mean of this many latest requests'."""


@dataclass(slots=True)
class SlotMeter:
    """How long a request holds an engine slot, on average (the router's per cluster, Pylon's per
    engine): from dispatch to its end, for requests sent while a slot was free (their time is
    service, not a wait) that had an answer. The wait for a slot at a full engine is a share of it
    per request ahead. Streamed or not, the whole answer counts: a slot is held until the last
    token."""

    mean_s: float = 0.0
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SLOT_SAMPLES))

    def ended(self, held_s: float) -> None:
        self.samples.append(held_s)
        self.mean_s = statistics.fmean(self.samples)


def slot_wait_ms(hold_s: float, running: int, limit: int) -> float:
    """Expected wait for a slot on a cluster whose ``limit`` slots hold ``running`` requests (those
    past the limit queue there) for ``hold_s`` each (``slot_hold_s``): a slot frees every
    ``hold_s / limit`` on average, and a new request waits for one per request queued ahead of it
    and one for itself. 0 with a free slot."""
    if limit <= 0 or running < limit:
        return 0.0
    return (running - limit + 1) * hold_s * 1000.0 / limit


def load_tie_key(score_ms: float, running: int, resolution_ms: float) -> tuple[float, int]:
    """Ranking key of the load-aware policies: estimates in the same ``resolution_ms``-wide step are
    ties (RTT noise must not decide), broken by fewer requests running (decode load); equal keys
    fall to the callers' coin (a backend a few ms closer drew every request of a light load).
    Without a step, the estimate, then requests running."""
    if resolution_ms > 0.0 and score_ms < INF:
        return (score_ms // resolution_ms, running)
    return (score_ms, running)


def prefill_ms(stats: ModelStats, input_tokens: int, scale: float = 1.0) -> float:
    """The request's own prefill time; ``scale`` discounts cached tokens but never rescues tps 0."""
    return prefill_at(stats.last_mean_input_tps, input_tokens, scale)


def prefill_at(tps: float, input_tokens: int, scale: float = 1.0) -> float:
    """``prefill_ms`` at a given rate (an unusable one makes any prompt infinite)."""
    if input_tokens == 0:
        return 0.0
    if not valid_tps(tps):
        return INF
    return input_tokens * scale * 1000.0 / tps


def ttft_ms(stats: ModelStats, rtt_s: float, input_tokens: int, priority: int) -> float:
    """Full time-to-first-token estimate: rtt + effective queue + prefill (§3.1)."""
    return rtt_s * 1000.0 + queue_ms(stats, priority) + prefill_ms(stats, input_tokens)


def has_capacity(stats: ModelStats, max_queued: int) -> bool:
    """Wait-and-widen capacity check: unknown concurrency never blocks (§3.4)."""
    limit = stats.max_engine_concurrency
    return limit == 0 or stats.num_running_queries < limit + max_queued


def _reservation_ms(tps: float, input_tokens: int) -> int | None:
    """Priority-map bump of one reservation: ``ceil(tokens / tps * 1000)`` ms, None with no valid tps."""
    if input_tokens == 0:
        return 0
    if not valid_tps(tps):
        return None
    millis = input_tokens / tps * 1000.0
    return U64_MAX if not math.isfinite(millis) or millis >= U64_MAX else math.ceil(millis)


def _bump_priority_map(
    estimates: Mapping[int, int], tps: float, pending: Collection[tuple[int, int]]
) -> Mapping[int, int]:
    """Every key gains the bumps of the reservations at its priority or more urgent ones; a
    reservation's priority missing from the map is inserted at its floor value first."""
    if not estimates:
        return estimates
    bumps: dict[int, int] = {}
    for input_tokens, priority in pending:
        delta = _reservation_ms(tps, input_tokens)
        if delta is None:
            return EMPTY_PRIORITY_MAP
        bumps[priority] = bumps.get(priority, 0) + delta
    bumped: dict[int, int] = {}
    floor = added = 0
    for key in sorted(estimates.keys() | bumps.keys()):
        floor = estimates.get(key, floor)
        added += bumps.get(key, 0)
        bumped[key] = saturating_add(floor, added)
    return MappingProxyType(bumped)


def with_reservation(stats: ModelStats, input_tokens: int, priority: int) -> ModelStats:
    """Apply one pending routing reservation (§1.9) to cluster stats.

    Load counters grow (saturating u64); the priority map gains ``ceil(tokens / tps * 1000)`` ms at
    the request priority (inserted from the floor lookup when missing) and every less urgent entry.
    With no request tokens the map gets a zero bump; with tokens but no valid tps it is cleared,
    because no per-priority estimate can account for the new work. Throughput, KV and concurrency
    fields are never touched.
    """
    return with_reservations(stats, ((input_tokens, priority),))


def with_reservations(stats: ModelStats, pending: Collection[tuple[int, int]]) -> ModelStats:
    """Apply every pending ``(input tokens, priority)`` reservation at once.

    Equal to applying ``with_reservation`` once per reservation, in any order: every change is a
    saturating sum of non-negative terms, and those commute. A cluster re-applies its pending
    reservations whenever one ends, so this runs once per request, not once per reservation.
    """
    if not pending:
        return stats
    count = len(pending)
    tokens = sum(input_tokens for input_tokens, _ in pending)
    return ModelStats(
        last_mean_input_tps=stats.last_mean_input_tps,
        output_tps=stats.output_tps,
        queue_size=saturating_add(stats.queue_size, count),
        queued_input_size=saturating_add(stats.queued_input_size, tokens),
        max_output_tps=stats.max_output_tps,
        kv_cache_capacity_tokens=stats.kv_cache_capacity_tokens,
        kv_cache_used_tokens=stats.kv_cache_used_tokens,
        kv_cache_free_tokens=stats.kv_cache_free_tokens,
        num_running_queries=saturating_add(stats.num_running_queries, count),
        max_engine_concurrency=stats.max_engine_concurrency,
        total_query_input_size=saturating_add(stats.total_query_input_size, tokens),
        queue_time_estimate_ms_by_priority=_bump_priority_map(
            stats.queue_time_estimate_ms_by_priority, stats.last_mean_input_tps, pending
        ),
        input_processing_queries=stats.input_processing_queries,
        output_generation_queries=stats.output_generation_queries,
        stats_observed_at_unix_ms=stats.stats_observed_at_unix_ms,
        stats_capabilities=stats.stats_capabilities,
        stats_sources=stats.stats_sources,
    )
