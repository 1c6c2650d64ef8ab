"""The suite's outputs: ``report.md``, ``comparison.json`` and PNG charts (spec §8, plus charts).

Formatting follows the original: percentages with one decimal, scores with three, milliseconds as
integers, ``-`` for a missing value. Runs appear in the order given (config order).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from stargate.bench.charts import write_charts
from stargate.bench.schema import Scenario
from stargate.bench.score import MemberSummary, RequestRecord, RunSummary
from stargate.bench.suite import across_repeats, markdown_table, repeats_table

_CACHE_TAGS = frozenset({"cache", "pulsar", "kv-cache"})
_LAG_WARNING_MS = 1000.0


def machine_info() -> dict[str, str]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = str(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        usable = "unknown"
    return {
        "cpu_model": model,
        "cpu_count": str(os.cpu_count() or "unknown"),
        "cpus_usable": usable,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


_RESULT_COLUMNS: list[tuple[str, Callable[[RunSummary], str]]] = [
    ("Run", lambda s: s.run),
    ("Success", lambda s: _pct(s.success_rate)),
    ("Req/s", lambda s: _rate(s.requests_per_second)),
    ("Out tok/s", lambda s: _rate(s.output_tokens_per_second)),
    ("TTFT p50 ms", lambda s: _ms(s.p50_ttft_ms)),
    ("TTFT p90 ms", lambda s: _ms(s.p90_ttft_ms)),
    ("TTFT p99 ms", lambda s: _ms(s.p99_ttft_ms)),
    ("TTLT p50 ms", lambda s: _ms(s.p50_ttlt_ms)),
    ("TTLT p99 ms", lambda s: _ms(s.p99_ttlt_ms)),
    ("Total s", lambda s: f"{s.total_length_s:.1f}"),
    ("Cache-hit req", lambda s: _pct(s.cache_hit_rate)),
    ("Input reuse", lambda s: _pct(s.input_reuse_rate)),
    ("SLO attain", lambda s: _pct(s.slo_attainment)),
    ("Goodput req/s", lambda s: _rate(s.goodput_rps)),
    ("Equal bal", lambda s: _score(s.equal_balance)),
    ("Capacity bal", lambda s: _score(s.capacity_balance)),
    ("Cluster input-cap bal", lambda s: _score(s.cluster_capacity_balance)),
    ("Jain", lambda s: _score(s.jain_index)),
    ("CV", lambda s: _score(s.load_cv)),
    ("Max/mean", lambda s: _score(s.max_over_mean)),
    ("In-flight imb", lambda s: _score(s.inflight_imbalance)),
    ("In-flight imb p99", lambda s: _score(s.inflight_imbalance_p99)),
    ("Per-slot imb", lambda s: _score(s.slot_inflight_imbalance)),
    ("Per-slot imb p99", lambda s: _score(s.slot_inflight_imbalance_p99)),
    ("Prefill imb", lambda s: _score(s.prefill_inflight_imbalance)),
    ("Key moves", lambda s: str(s.moved_cache_keys)),
    ("Lag p99 ms", lambda s: _ms(s.p99_schedule_lag_ms)),
    ("Retries", lambda s: str(s.retries_seen)),
    ("Timeouts", lambda s: str(s.timeouts)),
    ("Failures", lambda s: str(s.request_count - s.success_count)),
]


def _warnings(scenario: Scenario, summaries: Sequence[RunSummary]) -> list[str]:
    out = []
    if not summaries:
        out.append("no summaries found")
    cache_tagged = bool(_CACHE_TAGS & set(scenario.metadata.tags))
    for s in summaries:
        if s.success_rate < 1.0:
            out.append(f"{s.run}: success rate {_pct(s.success_rate)} is below 100%")
        if s.capacity_balance is not None and s.capacity_balance < 0.5:
            out.append(f"{s.run}: capacity balance {_score(s.capacity_balance)} is below 0.5")
        if cache_tagged and s.cache_observed == 0:
            out.append(f"{s.run}: cache-tagged scenario but no response carried KV cache headers")
        elif cache_tagged and s.cache_hits == 0:
            out.append(f"{s.run}: cache-tagged scenario but zero cache hits")
        if scenario.effective_mode == "open_loop" and (s.p99_schedule_lag_ms or 0.0) > _LAG_WARNING_MS:
            out.append(
                f"{s.run}: p99 schedule lag {_ms(s.p99_schedule_lag_ms)} ms — the concurrency cap saturated "
                "and the open loop behaved like a closed loop"
            )
    return out


def _member_rows(rows: Sequence[MemberSummary]) -> list[list[str]]:
    return [
        [
            row.member_id,
            str(row.request_count),
            str(row.success_count),
            _pct(row.request_share),
            _pct(row.input_token_share),
            _pct(row.capacity_share),
            _ms(row.avg_ttlt_ms),
            _ms(row.p95_ttlt_ms),
            _pct(row.cache_hit_rate),
            str(row.evicted_entries),
        ]
        for row in rows
    ]


_MEMBER_HEADERS = ["Member", "Requests", "Successes", "Request share", "Input share", "Capacity share",
                   "Avg TTLT ms", "p95 TTLT ms", "Hit rate", "Evictions"]  # fmt: skip


def _failure_cells(failure: Mapping[str, Any]) -> list[str]:
    status, backend = failure["status"], failure["backend_id"]
    return [str(status or "-"), str(backend or "-"), str(failure["error_class"]), str(failure["count"])]


def _requests_sent(planned: int, summaries: Sequence[RunSummary]) -> str:
    """What the runs sent: ``execution.duration_s``, a failure or Ctrl-C can stop one short of the plan."""
    sent = sorted({s.request_count for s in summaries})
    if not sent or sent == [planned]:
        return str(planned)
    counts = str(sent[0]) if len(sent) == 1 else f"{sent[0]}-{sent[-1]} per run"
    return f"{counts} sent of {planned} planned"


def render_markdown(scenario: Scenario, summaries: Sequence[RunSummary], charts: Sequence[str]) -> str:
    meta = scenario.metadata
    clusters = scenario.cluster_members()
    mode = scenario.effective_mode.replace("_", " ")
    lines = [f"# Benchmark Report: {scenario.name}", ""]
    if meta.description:
        lines += [meta.description, ""]
    lines += [
        f"- Model: {scenario.model}",
        f"- Requests: {_requests_sent(scenario.request_count, summaries)}",
        f"- Execution: {mode}, max concurrency {scenario.execution.workers or scenario.max_concurrency}",
        f"- Stargates: {scenario.stargates.count}",
        f"- Pylons: {scenario.backends.count}",
        f"- Routing clusters: {len(clusters)}",
        f"- Pylons per cluster: {scenario.backends.pylons_per_cluster}",
        f"- Traffic: {scenario.traffic_pattern.kind}",
        f"- Mock engine: KV mode {scenario.mock.kv_mode}, batching {scenario.mock.batching}",
        f"- Client timeout: {scenario.client.timeout_s:g} s",
        f"- Tags: {', '.join(meta.tags) or '-'}",
        f"- Expected runtime: {meta.expected_runtime or '-'}",
        f"- Expected signal: {meta.expected_signal or '-'}",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {key.replace('_', ' ')}: {value}" for key, value in machine_info().items()]
    warnings = _warnings(scenario, summaries)
    if warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in warnings]
    lines += ["", "## Results", ""]
    lines += markdown_table(
        [c for c, _ in _RESULT_COLUMNS], [[f(s) for _, f in _RESULT_COLUMNS] for s in summaries]
    )
    lines += [
        "",
        "Balance scores are 1 - total-variation distance over all backends, including idle ones. "
        "In-flight imb is the time-weighted mean over the run of max / mean in-flight requests across "
        "backends (1 = even, the backend count = all on one), p99 its 99th percentile over time; "
        "moments with nothing in flight are left out. Per-slot imb is the same over in-flight requests "
        "per engine slot (equal to In-flight imb when every backend has the same slots). Prefill imb "
        "is Per-slot imb over the requests still waiting for their first token: a pile-up there "
        "is what delays first tokens; answers being decoded hold slots but not the prefill.",
    ]
    grouped = across_repeats([s.to_dict() for s in summaries])
    if len(grouped) < len(summaries):
        note = "Medians of the per-run values above; success is the worst run's."
        lines += ["", "## Across repeats", "", note, "", *repeats_table(grouped)]
    if charts:
        lines += ["", "## Charts", ""] + [f"![{Path(c).stem}]({c})" for c in charts]
    for title, attr in (("Cluster Shares", "clusters"), ("Backend Shares", "backends")):
        lines += ["", f"## {title}"]
        for s in summaries:
            members = _member_rows(getattr(s, attr))
            lines += ["", f"### {s.run}", "", *markdown_table(_MEMBER_HEADERS, members)]
    failing = [(s.run, f) for s in summaries for f in s.failures]
    if failing:
        lines += ["", "## Failures", ""]
        lines += markdown_table(
            ["Run", "Status", "Backend", "Error", "Count"],
            [[run, *_failure_cells(f)] for run, f in failing],
        )
    return "\n".join(lines) + "\n"


def comparison(scenario: Scenario, summaries: Sequence[RunSummary]) -> list[dict[str, Any]]:
    admission = {
        entry.name: entry.pylon_queue_admission.model_dump() if entry.pylon_queue_admission else None
        for entry in scenario.algorithms
    }
    return [{**s.to_dict(), "pylon_queue_admission": admission.get(s.run)} for s in summaries]


def write_report(
    out_dir: Path,
    scenario: Scenario,
    summaries: Sequence[RunSummary],
    records_by_run: Mapping[str, Sequence[RequestRecord]],
) -> Path:
    """Write ``report.md``, ``comparison.json`` and the charts into ``out_dir``; return the report path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = [p.name for p in write_charts(out_dir, summaries, records_by_run)]
    (out_dir / "comparison.json").write_bytes(
        orjson.dumps(comparison(scenario, summaries), option=orjson.OPT_INDENT_2)
    )
    report = out_dir / "report.md"
    report.write_text(render_markdown(scenario, summaries, charts), encoding="utf-8")
    return report
