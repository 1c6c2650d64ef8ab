"""PNG charts of a suite (matplotlib, Agg backend): TTFT CDF, per-backend load over time, cache and goodput.

matplotlib is imported on first use so loading the bench package stays cheap. Load over time is the
number of requests in flight per backend, sampled on a fixed grid of ``_GRID`` points.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stargate.bench.score import RequestRecord, RunSummary

_GRID = 200
_DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def in_flight_series(
    records: Sequence[RequestRecord], points: int = _GRID
) -> tuple[list[float], dict[str, list[int]]]:
    """Grid times (s) and, per backend, the number of requests in flight at each time."""
    spans: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    last = 0.0
    for record in records:
        end = record.finished_s
        if record.backend_id is None or end is None:
            continue
        starts, ends = spans[record.backend_id]
        starts.append(record.dispatch_s)
        ends.append(end)
        last = max(last, end)
    grid = [last * i / (points - 1) for i in range(points)] if last > 0 else [0.0]
    series = {}
    for backend, (starts, ends) in sorted(spans.items()):
        starts.sort()
        ends.sort()
        series[backend] = [bisect.bisect_right(starts, t) - bisect.bisect_right(ends, t) for t in grid]
    return grid, series


def ttft_cdf(path: Path, records_by_run: Mapping[str, Sequence[RequestRecord]]) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, records in records_by_run.items():
        samples = sorted(
            (r.first_token_s - r.dispatch_s) * 1000.0 for r in records if r.first_token_s is not None
        )
        if samples:
            ax.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post", label=run)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    if records_by_run:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def backend_load(path: Path, records_by_run: Mapping[str, Sequence[RequestRecord]]) -> Path:
    plt = _pyplot()
    runs = list(records_by_run) or ["(no runs)"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.2 * len(runs) + 0.6), squeeze=False, sharex=True)
    for ax, run in zip((row[0] for row in axes), runs, strict=True):
        grid, series = in_flight_series(records_by_run.get(run, []))
        for backend, counts in series.items():
            ax.step(grid, counts, where="post", label=backend, linewidth=1)
        ax.set_title(run, fontsize="small")
        ax.set_ylabel("in flight")
        ax.grid(alpha=0.3)
        if series and len(series) <= 8:
            ax.legend(fontsize="x-small", ncol=4, loc="upper right")
    axes[-1][0].set_xlabel("time since replay start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def cache_and_goodput(path: Path, summaries: Sequence[RunSummary]) -> Path:
    plt = _pyplot()
    names = [s.run for s in summaries]
    x = list(range(len(names)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.4
    hit = [s.cache_hit_rate or 0.0 for s in summaries]
    reuse = [s.input_reuse_rate or 0.0 for s in summaries]
    left.bar([i - width / 2 for i in x], hit, width, label="hit requests")
    left.bar([i + width / 2 for i in x], reuse, width, label="reused tokens")
    left.set_ylim(0, 1)
    left.set_title("KV cache reuse")
    left.legend(fontsize="small")
    with_slo = any(s.goodput_rps is not None for s in summaries)
    rps = [s.requests_per_second or 0.0 for s in summaries]
    right.bar(x, rps, width, label="successful req/s", alpha=0.5)
    if with_slo:
        right.bar(x, [s.goodput_rps or 0.0 for s in summaries], width / 2, label="within TTFT SLO")
    right.set_title("Throughput and goodput")
    right.legend(fontsize="small")
    for ax in (left, right):
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize="small")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def write_charts(
    out_dir: Path, summaries: Sequence[RunSummary], records_by_run: Mapping[str, Sequence[RequestRecord]]
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        ttft_cdf(out_dir / "ttft-cdf.png", records_by_run),
        backend_load(out_dir / "backend-load.png", records_by_run),
        cache_and_goodput(out_dir / "cache-goodput.png", summaries),
    ]
