"""``wait-and-widen`` (spec §3.4 with the [PR] two-phase affinity wait of §3.10).

Candidates are grouped into TTFT buckets `bucket` ms wide. The fastest bucket is open at once; each
later bucket opens after the request has waited ``gap * factor`` ms more, so a request widens its
choice only as long as it has been waiting. Among open buckets the clusters with capacity are
sampled (``n``) and the comparator picks the winner; under ``load_aware`` every open cluster whose
estimate ties with the winner's is compared with it too, by requests running.

A phase evaluates one candidate set with one prefill scale and one "time waited" and yields
``PhaseResult``: a ``Choice``, a float wait hint (ms until the next time-locked bucket opens), or
None (nothing selectable and waiting alone will not help). The snapshot's single-bucket fast path
and two-index shortcut are not separate code paths here: both give the same choice distribution
as the general path they shortcut.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from enum import Enum

from stargate.balancer.algorithm_spec import AlgorithmSpec, Problem, check_prefill_rate
from stargate.balancer.comparators import score_for
from stargate.balancer.config_schema import WaitAndWidenFields
from stargate.balancer.estimates import (
    INF,
    load_queue_running_rate,
    load_running,
    load_tie_key,
    load_tps,
    prefill_at,
    queue_ms,
    sharing_queue_ms,
    slot_hold_s,
    slot_wait_ms,
)
from stargate.balancer.settings import (
    Algorithm,
    AlgorithmDefinition,
    Comparator,
    Placement,
    PrefillEstimate,
    PrefillRate,
)
from stargate.balancer.types import (
    UNAVAILABLE,
    AffinityRoute,
    Candidate,
    Choice,
    Decision,
    LbRequest,
    ModelStats,
    Selected,
    Wait,
)
from stargate.balancer.wait_and_widen_affinity import AffinityGroups

PhaseResult = Choice | float | None

Scale = float | dict[int, float]
"""The share of a prompt left to prefill: one for every candidate, or one per candidate index (a
spread key's group, whose members hold different parts of its prompts)."""

MAX_VIRTUAL_NODES = 1000
"""Ring points per cluster: 64 clusters x 1000 points take most of a second to hash (default 150)."""

AWAIT_PREFILL_POLL_MS = 10.0
"""How often a request held for its key's prefill looks again (the router sees a first byte at once)."""

GLOBAL_RANK_DEPTH = 2
"""rank_depth of a global (post-affinity-wait) pick: any value > 1 reports it as a fallback."""

# Entry layout of one evaluated candidate:
# (bucket ttft, cluster id, index, rank score, has capacity, requests running).
_Entry = tuple[float, str, int, float, bool, int]


class Ranking(Enum):
    TTFT = "ttft"  # rtt + effective queue + (scaled) prefill, ignore flags never applied
    QUEUE = "queue"  # effective queue delay
    PLAIN = "plain"  # the §3.2 comparator score
    LEAST_QUEUE = "least-queue"  # queue delay, ties by relative load (pulsar-wait-and-widen)


def _less_loaded(a: ModelStats, b: ModelStats) -> bool:
    limit_a, limit_b = a.max_engine_concurrency, b.max_engine_concurrency
    if limit_a == 0 or limit_b == 0:
        return a.num_running_queries < b.num_running_queries
    return a.num_running_queries / limit_a < b.num_running_queries / limit_b


class WawSelector:
    """Bucket formation, queue-SLO admission, capacity check, ``n`` sample and final ranking."""

    def __init__(self, definition: AlgorithmDefinition, ranking: Ranking) -> None:
        self._ranking = ranking
        self._load_aware = definition.load_aware
        self._sharing = definition.load_aware and definition.prefill_sharing
        self._measured = definition.prefill_rate is PrefillRate.MEASURED
        self._plain = score_for(definition.comparator, definition.load_aware, self._measured)
        # Load-aware ranks within this many ms tie (then fewer running wins); 0 for unit-less scores.
        self._resolution = 0.0 if ranking is Ranking.PLAIN else float(definition.ttft_bucket_size_ms)
        self._bucket = float(definition.ttft_bucket_size_ms)
        self._factor = definition.next_bucket_unlock_factor
        self._n = max(1, definition.n)
        self._max_queued = definition.max_queued
        self._ignore_queue = definition.ignore_queue_time
        self._ignore_prefill = definition.ignore_input_processing_time
        self.queue_slo = definition.queue_slo_ms

    def queue_limit_ms(self, request: LbRequest) -> float | None:
        """Allowed queue delay, interpolated from floor to ceil over the request's SLO (§3.4)."""
        slo = self.queue_slo
        if slo is None:
            return None
        floor, ceil = slo
        budget = request.request_slo_ms
        fraction = min(1.0, max(0.0, request.elapsed_ms / budget)) if budget else 1.0
        return floor + (ceil - floor) * fraction

    def phase(
        self,
        candidates: tuple[Candidate, ...],
        indices: Sequence[int] | None,
        request: LbRequest,
        scale: Scale,
        slept_ms: float,
        queue_limit: float | None,
        rng: random.Random,
        *,
        free_slot_only: bool = False,
    ) -> PhaseResult:
        """Evaluate ``indices`` (all candidates when None); excluded clusters are skipped, and
        with ``free_slot_only`` so are clusters at their slot limit (``max_queued`` not counted)."""
        excluded = request.excluded
        priority, tokens = request.priority, request.input_tokens
        plain = self._plain
        max_queued = 0 if free_slot_only else self._max_queued
        rank_ttft = self._ranking is Ranking.TTFT
        rank_plain = self._ranking is Ranking.PLAIN
        per_index, ms_per_token = (scale, 0.0) if isinstance(scale, dict) else (None, scale * 1000.0)
        ignore_queue, ignore_prefill = self._ignore_queue, self._ignore_prefill
        entries: list[_Entry] = []
        low, high, all_finite = INF, -INF, True
        pairs = enumerate(candidates) if indices is None else ((i, candidates[i]) for i in indices)
        load_aware, load_queue, now = self._load_aware, self._load_queue, request.now
        for index, candidate in pairs:
            cluster_id = candidate.cluster_id
            if excluded and cluster_id in excluded:
                continue
            stats = candidate.stats
            if per_index is not None:
                ms_per_token = per_index[index] * 1000.0
            if load_aware:
                # The free-slot rule stays the SLO filter; ranking and buckets see the load.
                if queue_limit is not None and queue_ms(candidate.checked_stats, priority) > queue_limit:
                    continue
                queue, running, tps = load_queue(candidate, priority, tokens * ms_per_token, now)
            else:
                queue = queue_ms(stats, priority)
                counted = candidate.pylon_stats
                checked = queue if counted is None else queue_ms(counted, priority)
                if queue_limit is not None and checked > queue_limit:
                    continue
                running = stats.num_running_queries
                tps = stats.last_mean_input_tps
            prefill = 0.0 if tokens == 0 else tokens * ms_per_token / tps if 0.0 < tps < INF else INF
            rtt = candidate.rtt_s * 1000.0
            bucket_ttft = rtt
            if not ignore_queue:
                bucket_ttft += queue
            if not ignore_prefill:
                bucket_ttft += prefill
            if rank_ttft:
                rank = rtt + queue + prefill
            elif rank_plain:
                rank = plain(candidate, priority, tokens)
            else:
                rank = queue
            limit = stats.max_engine_concurrency
            has_capacity = limit == 0 or running < limit + max_queued
            if free_slot_only and not has_capacity:
                continue
            entries.append((bucket_ttft, cluster_id, index, rank, has_capacity, running))
            if bucket_ttft < INF:
                if bucket_ttft < low:
                    low = bucket_ttft
                if bucket_ttft > high:
                    high = bucket_ttft
            else:
                all_finite = False
        if low == INF:
            return None
        hint: float | None = None
        if all_finite and high - low <= self._bucket:
            unlocked = entries
        else:
            unlocked, hint = self._unlock(entries, slept_ms)
        available = [entry for entry in unlocked if entry[4]]
        if not available:
            return hint
        return Choice(self._pick(candidates, available, rng))

    def _unlock(self, entries: list[_Entry], slept_ms: float) -> tuple[list[_Entry], float | None]:
        """Walk buckets in TTFT order, spending waited time to open each later bucket."""
        entries.sort()
        bucket, factor = self._bucket, self._factor
        start = entries[0][0]
        slept = slept_ms
        reached = 0
        for entry in entries:
            ttft = entry[0]
            if not ttft < INF:
                break
            gap = ttft - start
            if gap > bucket:
                need = gap * factor
                if slept < need:
                    return entries[:reached], need - slept
                slept -= need
                start = ttft
            reached += 1
        return entries[:reached], None

    def _load_queue(
        self, candidate: Candidate, priority: int, work_ms: float, now: float
    ) -> tuple[float, int, float]:
        """The load-aware queue term, requests running and prefill rate of ``candidate``; the
        request's prompt is ``work_ms / 1000`` tokens after its cache discount. With
        ``prefill_sharing`` the queue is the prefill it shares, else the work ahead; at the slot
        limit either includes the wait for a slot."""
        measured = self._measured
        if self._sharing:
            running, tps = load_running(candidate), load_tps(candidate, measured)
            return sharing_queue_ms(candidate, work_ms / 1000.0, tps, running, now), running, tps
        queue, running, tps = load_queue_running_rate(candidate, priority, measured)
        return _with_slot_wait(candidate, queue, running, now), running, tps

    def _load_key(self, entry: _Entry) -> tuple[float, int]:
        return load_tie_key(entry[3], entry[5], self._resolution)

    def best_ttft(
        self,
        candidates: tuple[Candidate, ...],
        indices: Sequence[int] | None,
        request: LbRequest,
        scale: Scale,
        queue_limit: float | None,
        *,
        free_slot_only: bool,
    ) -> float:
        """Lowest TTFT estimate (the ranking's queue notion, ``scale``d prefill) among ``indices``,
        with ``free_slot_only`` among those below their slot limit; the prefill is written flat: the
        yield check runs this per candidate of every keyed decision."""
        priority, tokens, excluded = request.priority, request.input_tokens, request.excluded
        load_aware, load_queue, now = self._load_aware, self._load_queue, request.now
        per_index, ms_per_token = (scale, 0.0) if isinstance(scale, dict) else (None, scale * 1000.0)
        best = INF
        pairs = enumerate(candidates) if indices is None else ((i, candidates[i]) for i in indices)
        for index, candidate in pairs:
            if excluded and candidate.cluster_id in excluded:
                continue
            stats = candidate.stats
            if per_index is not None:
                ms_per_token = per_index[index] * 1000.0
            if queue_limit is not None and queue_ms(candidate.checked_stats, priority) > queue_limit:
                continue
            if load_aware:
                queue, running, tps = load_queue(candidate, priority, tokens * ms_per_token, now)
            else:
                queue, running = queue_ms(stats, priority), stats.num_running_queries
                tps = stats.last_mean_input_tps
            limit = stats.max_engine_concurrency
            if free_slot_only and not (limit == 0 or running < limit):
                continue
            prefill = 0.0 if tokens == 0 else tokens * ms_per_token / tps if 0.0 < tps < INF else INF
            estimate = candidate.rtt_s * 1000.0 + queue + prefill
            if estimate < best:
                best = estimate
        return best

    def _pick(self, candidates: tuple[Candidate, ...], available: list[_Entry], rng: random.Random) -> int:
        """Partial Fisher-Yates over the first ``n`` positions, then the first best among them (and
        its ties, ``_least_loaded``)."""
        total = len(available)
        sample = min(self._n, total)
        if total > 1:
            for position in range(sample):
                other = position + int(rng.random() * (total - position))
                available[position], available[other] = available[other], available[position]
        if self._load_aware:
            return self._least_loaded(available, sample, rng)
        best = available[0]
        least_queue = self._ranking is Ranking.LEAST_QUEUE
        for position in range(1, sample):
            entry = available[position]
            if entry[3] < best[3] or (
                least_queue
                and entry[3] == best[3]
                and _less_loaded(candidates[entry[2]].stats, candidates[best[2]].stats)
            ):
                best = entry
        return best[2]

    def _least_loaded(self, available: list[_Entry], sample: int, rng: random.Random) -> int:
        """The sample's best by ``load_tie_key``, then the fewest running among every open cluster
        whose estimate ties with it; equal keys fall to a coin (reservoir). The sample hedges
        against errors of the estimates (stale stats, a wrong rate); requests running, this
        router's own count at the least, are exact and fresh, so a tie left out of the sample is a
        less loaded backend passed over for nothing (on four equal idle backends, the least loaded
        one half the time)."""
        load_key = self._load_key
        best = min(available[:sample], key=load_key)
        best_key = load_key(best)
        ties = sum(1 for entry in available[:sample] if load_key(entry) == best_key)
        for entry in available[sample:]:
            if entry[5] > best[5]:
                continue
            key = load_key(entry)
            if key[0] != best_key[0] or key > best_key:
                continue
            if key < best_key:
                best, best_key, ties = entry, key, 1
            else:
                ties += 1
                if rng.random() * ties < 1.0:
                    best = entry
        return best[2]


def _with_slot_wait(candidate: Candidate, queue: float, running: int, now: float) -> float:
    """A load-aware queue estimate that, at the slot limit (a pick ``max_queued`` allows), is at
    least the wait for a slot there: the prompt work ahead does not say when a slot frees."""
    limit = candidate.stats.max_engine_concurrency
    if limit <= 0 or running < limit:
        return queue
    return max(queue, slot_wait_ms(slot_hold_s(candidate, now), running, limit))


def _awaits_prefill(candidate: Candidate, request: LbRequest) -> bool:
    """The request's key has a request still prefilling on ``candidate``, and the routing deadline
    allows a wait. Not bounded by an estimate: with processor sharing the predecessor shares the
    engine with everything else, and any bound from published throughput released most waits
    just before the prefix was cached (docs/benchmarks.md)."""
    key = request.cache_affinity_key
    return request.now < request.wait_deadline and key is not None and _prefilling(candidate, key)


def _prefilling(candidate: Candidate, key: str) -> bool:
    """The key has a request before its first byte on the cluster: this router's (exact), or any
    router's as the backend last published (another replica's request prefilling it)."""
    return key in candidate.in_flight.prefilling_keys or key in candidate.stats.prefilling_cache_affinity_keys


def _spills(
    candidates: tuple[Candidate, ...],
    request: LbRequest,
    group: tuple[int, ...],
    scale: Scale,
    hold_ms: float,
    measured: bool,
) -> bool:
    """Every cluster of the group is at its slot limit and prefilling again elsewhere what the
    group holds cached (``1 - scale`` of the prompt, at its rate) is worth the wait it saves.

    When the key's requests are most of this router's in the group (at least two: each router
    replica sees its share of the traffic), the key is what fills it: its next requests will find it
    full too, so the cost is weighed against how long a request holds a slot there (a burst's
    requests free theirs together) and paid once for all of them. Otherwise the request is weighed
    alone, and only when the key already has a request there still before its first byte (this one
    would wait for a slot behind its own key): against the wait for a slot or X, the wait the
    configuration accepts for that cache, whichever is longer: a long conversation's history is
    worth more than a short wait, not more than a long one."""
    key = request.cache_affinity_key or ""
    waiting = False
    repeat = slot = slot_time = INF
    own = mine = 0
    for index in group:
        candidate = candidates[index]
        limit = candidate.stats.max_engine_concurrency
        running = load_running(candidate)
        if limit == 0 or running < limit:
            return False
        in_flight = candidate.in_flight
        waiting = waiting or _prefilling(candidate, key)
        own += in_flight.keys.get(key, 0)
        mine += in_flight.requests
        cached = 1.0 - _scale_at(scale, index)
        repeat = min(repeat, prefill_at(load_tps(candidate, measured), request.input_tokens, cached))
        hold_s = slot_hold_s(candidate, request.now)
        slot = min(slot, slot_wait_ms(hold_s, running, limit))
        slot_time = min(slot_time, hold_s * 1000.0)
    if own >= 2 and 2 * own > mine:
        return repeat <= max(hold_ms, slot_time)
    return waiting and repeat <= max(hold_ms, slot)


def _scale_at(scale: Scale, index: int) -> float:
    return scale[index] if isinstance(scale, dict) else scale


def as_decision(result: PhaseResult) -> Decision:
    if isinstance(result, Choice):
        return Selected(result)
    if result is not None:
        return Wait(result)
    return UNAVAILABLE


def check_affinity_settings(definition: AlgorithmDefinition) -> Problem | None:
    scale = definition.cache_affinity_input_tokens_scale
    if not 0.0 <= scale <= 1.0:  # also rejects NaN
        return (
            "cache_affinity_input_tokens_scale",
            f"cache_affinity_input_tokens_scale must be between 0.0 and 1.0, got {scale!r}",
        )
    return None


class WaitAndWiden:
    """Plain WAW over all candidates, or the two-phase affinity decision when a group applies.

    Two-phase decision (§3.10), ``elapsed`` measured from arrival and ``X = cache_affinity_wait_ms``:
    the affinity group (scaled prefill) is tried first on every attempt; before X the decision is
    a Wait for the earlier of X and the group's next bucket unlock; from X on, every non-excluded
    candidate competes at full prefill with buckets widening only by ``elapsed - X``, and a pick
    there is reported with ``rank_depth`` 2. Without a group (no key, or no selection count) the
    plain decision waits for the next bucket unlock when a bucket is locked only by time.

    With ``cache_affinity_yield_margin_ms`` (not in the original) the group yields to load: when
    its best estimate is worse by more than the margin than the best global one among clusters
    with a free slot (charged the cached prefill the move repeats), the request is routed at once
    (``rank_depth`` 2) to such a cluster, before or after X, and the key follows it: its KV cache
    is where that request went, so that cluster becomes the key's group.

    With ``cache_affinity_placement: load`` (not in the original) a key's first request is decided
    like a request without a key, over every candidate at full prefill, and the key is placed where
    it went; the ring is not used. A global pick after X places the key where it went as well (a
    conversation's next turn extends the prompt sent there; sent back to the old group it would
    prefill that turn again).

    With ``cache_affinity_prefill: growth`` (not in the original) the group's prefill is what the
    prompt grew by since the key's last request went there (a conversation re-sends its history),
    instead of the scaled input; the scale stays the estimate when that is unknown.

    With ``cache_affinity_await_prefill`` (not in the original) a request whose pick in the group is
    still prefilling an earlier request of the same key from this router waits for that prefill to
    end (its first byte), until its routing deadline at the latest (``_awaits_prefill``): sent
    beside it, the request would prefill the shared prefix again instead of finding it cached. The
    yield rule still moves it when the group loses by the margin.

    With ``cache_affinity_spill`` (not in the original) a key's requests spill past its group's
    slots: when every cluster of the group is at its slot limit and the key already has a request
    there waiting for its first byte (``_spills``), the request goes at once (``rank_depth`` 2) to
    the best cluster with a free slot, provided that prefilling the cached part again there takes no
    longer than X or the wait for a slot in the group (``estimates.slot_wait_ms``), whichever is
    longer; when the key's requests are most of this router's there, none of them need wait there
    and the bound is how long a request holds a slot. That cluster joins the key's group
    (``AffinityGroups.spread``): the clusters it leaves still hold the key's cache, and the key's
    next requests fill their slots again. Requests of one key sent together then share as many
    replicas as their load needs instead of queueing for one's; a conversation, one turn at a time,
    is not spread by it.

    Whenever keys are placed (any option above), ``learn_routes`` takes the routes Pylon
    publishes, so router replicas follow each other's placements (``AffinityGroups.learn``); with
    the spill, a route elsewhere of a key this router has a request of in flight spreads it there
    (another replica spilled it) instead of moving it.
    """

    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        comparator = definition.comparator or Comparator.TTFT
        if comparator is Comparator.TTFT:
            ranking = Ranking.TTFT
        elif comparator is Comparator.QUEUE_TIME:
            ranking = Ranking.QUEUE
        else:
            ranking = Ranking.PLAIN
        self._selector = WawSelector(definition, ranking)
        count = definition.selection_count
        self._groups = AffinityGroups(definition, count) if count else None
        self._wait_ms = float(definition.cache_affinity_wait_ms)
        self._scale = definition.cache_affinity_input_tokens_scale
        margin = definition.cache_affinity_yield_margin_ms
        self._yield_margin = None if margin is None else float(margin)
        self._growth = definition.cache_affinity_prefill is PrefillEstimate.GROWTH
        self._spill = definition.cache_affinity_spill
        self._measured = definition.prefill_rate is PrefillRate.MEASURED
        self._learns = self._groups is not None and (
            self._yield_margin is not None
            or self._spill
            or definition.cache_affinity_placement is Placement.LOAD
        )
        self._records = self._learns or self._growth
        self._await_prefill = definition.cache_affinity_await_prefill

    def learn_routes(
        self,
        cluster_id: str,
        routes: Sequence[AffinityRoute],
        offset_s: float,
        in_flight: Callable[[str], bool],
    ) -> None:
        """Routes a backend of ``cluster_id`` published; ``offset_s`` turns their wall-clock
        milliseconds into the requests' monotonic seconds; ``in_flight`` says whether this router
        has a request of a key in flight (its requests run in parallel, so a route elsewhere is a
        spread, not a move)."""
        groups = self._groups
        if groups is None or not self._learns:
            return
        spreads = self._spill
        for route in routes:
            at = route.admitted_at_unix_ms / 1000.0 + offset_s
            key = route.key
            groups.learn(key, cluster_id, route.input_tokens, at, spreads and in_flight(key))

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        if not candidates:
            return UNAVAILABLE
        selector = self._selector
        queue_limit = selector.queue_limit_ms(request)
        key = request.cache_affinity_key
        groups = self._groups
        if key and groups is not None:
            group = groups.group(candidates, request.target, key)
            if group:
                scale = self._group_scale(groups, candidates, request, group, key)
                decision, spilled = self._decide_with_affinity(
                    candidates, request, group, scale, queue_limit, rng
                )
                if isinstance(decision, Selected):
                    cluster_id = candidates[decision.choice.index].cluster_id
                    if spilled:
                        groups.spread(key, tuple(candidates[i].cluster_id for i in group), cluster_id)
                    elif self._learns and decision.choice.rank_depth == GLOBAL_RANK_DEPTH:
                        groups.place(key, cluster_id)
                    if self._records:
                        groups.routed(key, cluster_id, request.input_tokens, request.now)
                return decision
            # Placed by load: a new key has no cache anywhere, so it goes where the estimate is best.
            plain = as_decision(
                selector.phase(candidates, None, request, 1.0, request.elapsed_ms, queue_limit, rng)
            )
            if isinstance(plain, Selected):
                cluster_id = candidates[plain.choice.index].cluster_id
                groups.place(key, cluster_id)
                if self._records:
                    groups.routed(key, cluster_id, request.input_tokens, request.now)
            return plain
        return as_decision(
            selector.phase(candidates, None, request, 1.0, request.elapsed_ms, queue_limit, rng)
        )

    def _group_scale(
        self,
        groups: AffinityGroups,
        candidates: tuple[Candidate, ...],
        request: LbRequest,
        group: tuple[int, ...],
        key: str,
    ) -> Scale:
        """Share of the input each member of the group still has to prefill: with ``growth`` what
        the prompt grew by since the key's last request there, else (or when that is unknown)
        ``cache_affinity_input_tokens_scale``."""
        tokens = request.input_tokens
        if not (self._growth and tokens):
            return self._scale

        def share(index: int) -> float:
            uncached = groups.uncached_tokens(key, candidates[index].cluster_id, tokens)
            return self._scale if uncached is None else uncached / tokens

        return share(group[0]) if len(group) == 1 else {index: share(index) for index in group}

    def _decide_with_affinity(
        self,
        candidates: tuple[Candidate, ...],
        request: LbRequest,
        group: tuple[int, ...],
        scale: Scale,
        queue_limit: float | None,
        rng: random.Random,
    ) -> tuple[Decision, bool]:
        """The decision, and whether it spilled past the full group (the key then spreads)."""
        excluded = request.excluded
        if excluded and all(candidate.cluster_id in excluded for candidate in candidates):
            return UNAVAILABLE, False
        elapsed = request.elapsed_ms
        selector = self._selector
        loses = self._affinity_loses
        spills = self._spill and _spills(
            candidates, request, group, scale, self._wait_ms, self._measured
        )
        if spills or (
            self._yield_margin is not None and loses(candidates, request, group, scale, queue_limit)
        ):
            slept = max(0.0, elapsed - self._wait_ms)
            public = selector.phase(
                candidates, None, request, 1.0, slept, queue_limit, rng, free_slot_only=True
            )
            if isinstance(public, Choice):
                return Selected(Choice(public.index, rank_depth=GLOBAL_RANK_DEPTH)), spills
        affine = selector.phase(candidates, group, request, scale, elapsed, queue_limit, rng)
        if isinstance(affine, Choice):
            if self._await_prefill and _awaits_prefill(candidates[affine.index], request):
                wait_ms = min(AWAIT_PREFILL_POLL_MS, (request.wait_deadline - request.now) * 1000.0)
                return Wait(wait_ms), False
            if self.definition.load_aware:
                # Work in flight there is the uncached part, as the estimate assumed.
                expected = round(request.input_tokens * _scale_at(scale, affine.index))
                return Selected(Choice(affine.index, prefill_tokens=expected)), False
            return Selected(affine), False
        if elapsed < self._wait_ms:
            remaining = self._wait_ms - elapsed
            return Wait(remaining if affine is None else min(affine, remaining)), False
        public = selector.phase(candidates, None, request, 1.0, elapsed - self._wait_ms, queue_limit, rng)
        if isinstance(public, Choice):
            return Selected(Choice(public.index, rank_depth=GLOBAL_RANK_DEPTH)), False
        hints = [hint for hint in (affine, public) if hint is not None]
        return (Wait(min(hints)) if hints else UNAVAILABLE), False

    def _affinity_loses(
        self,
        candidates: tuple[Candidate, ...],
        request: LbRequest,
        group: tuple[int, ...],
        scale: Scale,
        queue_limit: float | None,
    ) -> bool:
        """The group's best estimate (cache discount applied, full members included: their queue
        estimate is the wait) is worse by more than the margin than the best global one among the
        clusters with a free slot, charged the prefill the move repeats.

        A move re-prefills what the group holds cached (``1 - scale`` of the prompt), and the
        requests that queue behind it there (or share the engine with it) wait for that work too,
        so a global estimate counts that part twice. When every cluster is at its slot limit a move
        would only trade one queue for another: the group holds.

        A group estimated within the margin holds without reading the other clusters: their
        estimates are sums of non-negative terms (the common case, and the one that would cost a
        pass over the whole fleet per keyed request)."""
        best, margin = self._selector.best_ttft, self._yield_margin
        if margin is None:
            return False
        affine = best(candidates, group, request, scale, queue_limit, free_slot_only=False)
        cached = 1.0 - (min(scale.values()) if isinstance(scale, dict) else scale)
        charged = 1.0 + cached
        if affine <= margin and charged >= 0.0:
            return False
        public = best(candidates, None, request, charged, queue_limit, free_slot_only=True)
        return public < INF and affine > public + margin


def _check(definition: AlgorithmDefinition) -> Problem | None:
    """The ring is rebuilt on the event loop whenever the candidates change: its size is bounded."""
    nodes = definition.virtual_nodes
    if nodes > MAX_VIRTUAL_NODES:
        return (
            "cache_affinity_virtual_nodes",
            f"cache_affinity_virtual_nodes must be at most {MAX_VIRTUAL_NODES}, got {nodes}",
        )
    if definition.cache_affinity_placement is Placement.LOAD and definition.selection_count != 1:
        return (
            "cache_affinity_placement",
            "cache_affinity_placement \"load\" places a key on one backend: "
            "set cache_affinity_backend_selection_count to 1",
        )
    if problem := check_prefill_rate(definition):
        return problem
    if definition.prefill_sharing and not definition.load_aware:
        return (
            "prefill_sharing",
            "prefill_sharing is read by the load-aware estimates: set load_aware to true",
        )
    if definition.cache_affinity_await_prefill and not definition.selection_count:
        return (
            "cache_affinity_await_prefill",
            "cache_affinity_await_prefill holds a key's request for its affinity group: "
            "set cache_affinity_backend_selection_count",
        )
    if definition.cache_affinity_spill and not definition.selection_count:
        return (
            "cache_affinity_spill",
            "cache_affinity_spill lets a key's requests past its affinity group's slots: "
            "set cache_affinity_backend_selection_count",
        )
    if definition.cache_affinity_prefill is PrefillEstimate.GROWTH and definition.selection_count != 1:
        return (
            "cache_affinity_prefill",
            "cache_affinity_prefill \"growth\" follows a key's prompt on one backend: "
            "set cache_affinity_backend_selection_count to 1",
        )
    return check_affinity_settings(definition)


SPEC = AlgorithmSpec(
    Algorithm.WAIT_AND_WIDEN,
    build=WaitAndWiden,
    fields=WaitAndWidenFields,
    aliases=("groq-multiregion",),
    comparator=True,
    seeded=True,
    check=_check,
)
