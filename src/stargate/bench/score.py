"""Scoring: per-request records become one :class:`RunSummary` per run (spec §6, §7).

Latency formulas follow the original exactly (TTFT from dispatch to the first content chunk;
percentile = element ``floor((n - 1)·q + 0.5)`` of the sorted samples, i.e. Rust's half-away-from-zero
``round``). Balance is fixed (spec §15.1): shares are taken over **all** backends of the topology,
including those that served nothing, and every share score is ``1 - total-variation distance``
(one scale). Jain's index, the coefficient of variation and max/mean of per-backend successes are
added, as are goodput under a TTFT SLO, schedule lag, TPOT and delivered-token goodput (§15.9), and
the time-resolved in-flight imbalance (:mod:`stargate.bench.imbalance`).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from stargate.bench import plan
from stargate.bench.imbalance import in_flight_imbalance
from stargate.bench.schema import Scenario


@dataclass
class RequestRecord:
    """One request as the driver saw it; times are seconds from replay start."""

    index: int
    request_id: str
    run: str
    scheduled_s: float
    dispatch_s: float
    headers_s: float | None
    first_token_s: float | None
    last_token_s: float | None
    status: int | None
    error_class: str | None  # None = ok; "timeout", "connect", "http_503", "stream_cut", ...
    backend_id: str | None
    cluster_id: str | None
    engine_id: str | None
    cache_hit: bool | None
    cache_hit_tokens: int | None
    input_tokens: int
    output_tokens: int
    chunks: int
    retries_seen: int
    end_s: float | None = None  # end of the body or time of the error; falls back to last_token_s
    cache_affinity_key: str | None = None
    session: str | None = None
    evicted_entries: int | None = None
    evicted_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error_class is None and self.status is not None and 200 <= self.status < 300

    @property
    def finished_s(self) -> float | None:
        return self.end_s if self.end_s is not None else self.last_token_s

    @property
    def waited_until_s(self) -> float | None:
        """When the wait for a first token ended: at it, or at the end of a request that had none."""
        return self.first_token_s if self.first_token_s is not None else self.finished_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass
class MemberSummary:
    """One backend or cluster: attributed requests (any outcome) and what they did."""

    member_id: str
    request_count: int = 0
    success_count: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    request_share: float = 0.0
    input_token_share: float = 0.0
    capacity_share: float | None = None
    avg_ttlt_ms: float | None = None
    p95_ttlt_ms: float | None = None
    cache_hit_rate: float | None = None
    evicted_entries: int = 0


@dataclass
class RunSummary:
    run: str
    request_count: int
    success_count: int
    success_rate: float
    total_length_s: float
    duration_s: float
    requests_per_second: float | None
    output_tokens_per_second: float | None  # delivered (streamed chunks) of successful requests
    planned_output_tokens_per_second: float | None  # the original's "Output Goodput" (planned tokens)
    avg_ttft_ms: float | None
    p50_ttft_ms: float | None
    p90_ttft_ms: float | None
    p95_ttft_ms: float | None
    p99_ttft_ms: float | None
    avg_ttlt_ms: float | None
    p50_ttlt_ms: float | None
    p90_ttlt_ms: float | None
    p95_ttlt_ms: float | None
    p99_ttlt_ms: float | None
    max_ttlt_ms: float | None
    p50_tpot_ms: float | None
    p99_tpot_ms: float | None
    p50_schedule_lag_ms: float | None
    p99_schedule_lag_ms: float | None
    max_schedule_lag_ms: float | None
    slo_ttft_ms: float | None
    slo_attainment: float | None
    goodput_rps: float | None
    cache_observed: int
    cache_hits: int
    cache_misses: int
    cache_hit_rate: float | None
    reused_input_tokens: int
    uncached_input_tokens: int
    input_reuse_rate: float | None
    evicted_entries: int
    evicted_tokens: int
    moved_cache_keys: int
    cache_key_movement_rate: float | None
    equal_balance: float | None
    capacity_balance: float | None
    cluster_equal_balance: float | None
    cluster_capacity_balance: float | None
    jain_index: float | None
    load_cv: float | None
    max_over_mean: float | None
    parity_equal_balance: float | None  # the original's flawed score, kept for comparison only
    inflight_imbalance: float | None  # time-weighted mean of max/mean in-flight across backends
    inflight_imbalance_p99: float | None  # its time-weighted 99th percentile
    slot_inflight_imbalance: float | None  # the same over in-flight per engine slot
    slot_inflight_imbalance_p99: float | None
    prefill_inflight_imbalance: float | None  # per slot, over requests before their first token
    retries_seen: int
    timeouts: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    backends: list[MemberSummary] = field(default_factory=list)
    clusters: list[MemberSummary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Element ``floor((n - 1)·q + 0.5)`` of the sorted values (n=768, q=.99 → index 759)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.floor((len(ordered) - 1) * q + 0.5))]


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def shares(counts: Mapping[str, float]) -> dict[str, float]:
    total = sum(counts.values())
    return {key: value / total for key, value in counts.items()} if total > 0 else {}


def tvd_balance(observed: Mapping[str, float], expected: Mapping[str, float]) -> float | None:
    """``1 - ½ Σ |obs - exp|`` over the union of ids; None when either side is empty."""
    if not observed or not expected:
        return None
    ids = set(observed) | set(expected)
    distance = sum(abs(observed.get(i, 0.0) - expected.get(i, 0.0)) for i in ids) / 2.0
    return min(1.0, max(0.0, 1.0 - distance))


def equal_share_balance(counts: Mapping[str, float]) -> float | None:
    """TVD balance against 1/N over every member in ``counts`` (zeros included: the §15.1 fix)."""
    observed = shares(counts)
    if not observed:
        return None
    return tvd_balance(observed, {key: 1.0 / len(counts) for key in counts})


def parity_equal_balance(counts: Mapping[str, float]) -> float | None:
    """The original's score: 1 - L1 against 1/N over members with > 0 (one backend alone scores 1)."""
    present = {key: value for key, value in counts.items() if value > 0}
    observed = shares(present)
    if not observed:
        return None
    n = len(observed)
    return min(1.0, max(0.0, 1.0 - sum(abs(share - 1.0 / n) for share in observed.values())))


def jain_index(loads: Iterable[float]) -> float | None:
    """(Σx)² / (N·Σx²): 1 for perfect balance, 1/N when one member takes everything."""
    values = list(loads)
    squares = sum(x * x for x in values)
    return (sum(values) ** 2) / (len(values) * squares) if values and squares > 0 else None


def coefficient_of_variation(loads: Iterable[float]) -> float | None:
    values = list(loads)
    average = mean(values)
    return statistics.pstdev(values) / average if average else None


def max_over_mean(loads: Iterable[float]) -> float | None:
    values = list(loads)
    average = mean(values)
    return max(values) / average if average else None


def _ms(seconds: float) -> float:
    return seconds * 1000.0


def _members(
    scenario: Scenario, pylons_in_path: bool
) -> tuple[dict[str, str], dict[str, float], dict[str, float]]:
    """Attribution universe: member id → cluster id, → capacity weight and → engine slots.

    The Pylon ids of the topology; for a run without Pylons in its path, the engines, each with the
    capacity and slots of its Pylons (such a run's backend ids are only named after the engine: with
    several Pylons per engine, one of them, which served nothing).
    """
    specs = plan.backend_specs(scenario)
    weights, slots = scenario.capacity_weights(), scenario.slot_counts()
    if pylons_in_path:
        return {s.backend_id: s.cluster_id for s in specs}, weights, slots
    cluster_of: dict[str, str] = {}
    capacity: dict[str, float] = defaultdict(float)
    engine_slots: dict[str, float] = defaultdict(float)
    for spec in specs:
        cluster_of[spec.engine_id] = spec.cluster_id
        capacity[spec.engine_id] += weights[spec.backend_id]
        engine_slots[spec.engine_id] += slots[spec.backend_id]
    return cluster_of, dict(capacity), dict(engine_slots)


def _member_of(record: RequestRecord, pylons_in_path: bool) -> str | None:
    return (record.backend_id or record.engine_id) if pylons_in_path else record.engine_id


def _summarize_members(
    groups: Mapping[str, list[RequestRecord]], universe: Iterable[str], capacity: Mapping[str, float]
) -> list[MemberSummary]:
    capacity_share = shares(capacity)
    successes = {key: sum(r.ok for r in groups.get(key, [])) for key in universe}
    inputs = {key: sum(r.input_tokens for r in groups.get(key, [])) for key in universe}
    request_share, input_share = shares(successes), shares(inputs)
    out = []
    for key in universe:
        items = groups.get(key, [])
        ttlt = [_ms(r.finished_s - r.dispatch_s) for r in items if r.finished_s is not None]
        observed = [r.cache_hit for r in items if r.cache_hit is not None]
        out.append(
            MemberSummary(
                member_id=key,
                request_count=len(items),
                success_count=successes[key],
                input_tokens=inputs[key],
                output_tokens=sum(r.output_tokens for r in items if r.ok),
                request_share=request_share.get(key, 0.0),
                input_token_share=input_share.get(key, 0.0),
                capacity_share=capacity_share.get(key),
                avg_ttlt_ms=mean(ttlt),
                p95_ttlt_ms=percentile(ttlt, 0.95),
                cache_hit_rate=(sum(observed) / len(observed)) if observed else None,
                evicted_entries=sum(r.evicted_entries or 0 for r in items),
            )
        )
    return out


def summarize(
    run: str,
    records: Sequence[RequestRecord],
    scenario: Scenario,
    duration_s: float,
    slo_ttft_ms: float | None,
    *,
    pylons_in_path: bool = True,
) -> RunSummary:
    """Score one run; without ``slo_ttft_ms`` the scenario's ``client.request_slo_ms`` is the TTFT SLO.

    ``pylons_in_path=False`` (a router without Pylons) scores its backends as the engines.
    """
    if slo_ttft_ms is None:
        slo_ttft_ms = scenario.client.request_slo_ms
    oks = [r for r in records if r.ok]
    ttft = [_ms(r.first_token_s - r.dispatch_s) for r in records if r.first_token_s is not None]
    ttlt = [_ms(r.finished_s - r.dispatch_s) for r in records if r.finished_s is not None]
    tpot = [
        _ms(r.last_token_s - r.first_token_s) / (r.chunks - 1)
        for r in oks
        if r.first_token_s is not None and r.last_token_s is not None and r.chunks > 1
    ]
    lag = [_ms(max(0.0, r.dispatch_s - r.scheduled_s)) for r in records]
    ends = [r.finished_s for r in records if r.finished_s is not None]
    starts = [r.dispatch_s for r in records]
    total = (max(ends) - min(starts)) if ends and starts else 0.0
    per_s = (lambda value: value / total) if total > 0 else (lambda value: None)

    within = None
    if slo_ttft_ms is not None:
        limit = slo_ttft_ms / 1000.0
        within = [r for r in oks if r.first_token_s is not None and r.first_token_s - r.dispatch_s <= limit]

    observed = [r for r in records if r.cache_hit is not None]
    hits = sum(1 for r in observed if r.cache_hit)
    reused = sum(r.cache_hit_tokens or 0 for r in observed)
    uncached = sum(max(0, r.input_tokens - (r.cache_hit_tokens or 0)) for r in observed)

    cluster_of, capacity, _ = _members(scenario, pylons_in_path)
    by_member: dict[str, list[RequestRecord]] = defaultdict(list)
    by_cluster: dict[str, list[RequestRecord]] = defaultdict(list)
    key_clusters: dict[str, set[str]] = defaultdict(set)
    for record in records:
        member = _member_of(record, pylons_in_path)
        if member is None:
            continue
        by_member[member].append(record)
        cluster = record.cluster_id or cluster_of.get(member, member)
        by_cluster[cluster].append(record)
        if record.ok and record.cache_affinity_key is not None:
            key_clusters[record.cache_affinity_key].add(cluster)
    universe = [*cluster_of, *(m for m in by_member if m not in cluster_of)]
    clusters = [*dict.fromkeys(cluster_of.values()), *(c for c in by_cluster if c not in cluster_of.values())]
    cluster_capacity: dict[str, float] = defaultdict(float)
    for member, weight in capacity.items():
        cluster_capacity[cluster_of[member]] += weight
    backend_rows = _summarize_members(by_member, universe, capacity)
    cluster_rows = _summarize_members(by_cluster, clusters, cluster_capacity)
    loads = {row.member_id: float(row.success_count) for row in backend_rows}
    cluster_loads = {row.member_id: float(row.success_count) for row in cluster_rows}
    cluster_inputs = {row.member_id: float(row.input_tokens) for row in cluster_rows}
    moved = sum(1 for seen in key_clusters.values() if len(seen) > 1)
    # Requests pile up on engines: the in-flight figures count per engine whatever the router, so a
    # Stargate run (backends are Pylons, several to an engine on grouped fleets) and a router
    # without Pylons are measured alike; with one Pylon per engine the two are the same.
    _, _, engine_slots = _members(scenario, pylons_in_path=False)
    engines = list(engine_slots)
    engine_of = {spec.backend_id: spec.engine_id for spec in plan.backend_specs(scenario)}
    at = [(engine, r) for r in records if (engine := r.engine_id or engine_of.get(r.backend_id or ""))]
    spans = [(engine, r.dispatch_s, r.finished_s) for engine, r in at if r.finished_s is not None]
    imbalance = in_flight_imbalance(spans, engines)
    slot_imbalance = in_flight_imbalance(spans, engines, engine_slots)
    waiting = [(engine, r.dispatch_s, end) for engine, r in at if (end := r.waited_until_s) is not None]
    prefill_imbalance = in_flight_imbalance(waiting, engines, engine_slots)
    failures = Counter((r.status, r.backend_id, r.error_class or "not_ok") for r in records if not r.ok)

    return RunSummary(
        run=run,
        request_count=len(records),
        success_count=len(oks),
        success_rate=len(oks) / len(records) if records else 0.0,
        total_length_s=total,
        duration_s=duration_s,
        requests_per_second=per_s(len(oks)),
        output_tokens_per_second=per_s(sum(r.chunks for r in oks)),
        planned_output_tokens_per_second=per_s(sum(r.output_tokens for r in oks)),
        avg_ttft_ms=mean(ttft),
        p50_ttft_ms=percentile(ttft, 0.50),
        p90_ttft_ms=percentile(ttft, 0.90),
        p95_ttft_ms=percentile(ttft, 0.95),
        p99_ttft_ms=percentile(ttft, 0.99),
        avg_ttlt_ms=mean(ttlt),
        p50_ttlt_ms=percentile(ttlt, 0.50),
        p90_ttlt_ms=percentile(ttlt, 0.90),
        p95_ttlt_ms=percentile(ttlt, 0.95),
        p99_ttlt_ms=percentile(ttlt, 0.99),
        max_ttlt_ms=max(ttlt) if ttlt else None,
        p50_tpot_ms=percentile(tpot, 0.50),
        p99_tpot_ms=percentile(tpot, 0.99),
        p50_schedule_lag_ms=percentile(lag, 0.50),
        p99_schedule_lag_ms=percentile(lag, 0.99),
        max_schedule_lag_ms=max(lag) if lag else None,
        slo_ttft_ms=slo_ttft_ms,
        slo_attainment=(len(within) / len(records)) if within is not None and records else None,
        goodput_rps=per_s(len(within)) if within is not None else None,
        cache_observed=len(observed),
        cache_hits=hits,
        cache_misses=len(observed) - hits,
        cache_hit_rate=hits / len(observed) if observed else None,
        reused_input_tokens=reused,
        uncached_input_tokens=uncached,
        input_reuse_rate=reused / (reused + uncached) if reused + uncached > 0 else None,
        evicted_entries=sum(r.evicted_entries or 0 for r in records),
        evicted_tokens=sum(r.evicted_tokens or 0 for r in records),
        moved_cache_keys=moved,
        cache_key_movement_rate=moved / len(key_clusters) if key_clusters else None,
        equal_balance=equal_share_balance(loads),
        capacity_balance=tvd_balance(shares(loads), shares(capacity)),
        cluster_equal_balance=equal_share_balance(cluster_loads),
        cluster_capacity_balance=tvd_balance(shares(cluster_inputs), shares(cluster_capacity)),
        jain_index=jain_index(loads.values()),
        load_cv=coefficient_of_variation(loads.values()),
        max_over_mean=max_over_mean(loads.values()),
        parity_equal_balance=parity_equal_balance(loads),
        inflight_imbalance=imbalance.mean,
        inflight_imbalance_p99=imbalance.p99,
        slot_inflight_imbalance=slot_imbalance.mean,
        slot_inflight_imbalance_p99=slot_imbalance.p99,
        prefill_inflight_imbalance=prefill_imbalance.mean,
        retries_seen=sum(r.retries_seen for r in records),
        timeouts=sum(1 for r in records if r.error_class == "timeout"),
        failures=[
            {"status": status, "backend_id": backend, "error_class": error, "count": count}
            for (status, backend, error), count in sorted(
                failures.items(), key=lambda kv: (-kv[1], str(kv[0]))
            )
        ],
        backends=backend_rows,
        clusters=cluster_rows,
    )
