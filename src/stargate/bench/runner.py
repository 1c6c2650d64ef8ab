"""The suite runner: per run (algorithm, repeat) a fresh fleet, one replay, teardown; then the report.

A run that fails (a process that never got ready, a fleet that never became routable, a crash during
replay) is recorded as failed with its error and the suite carries on; cancellation (Ctrl-C, SIGTERM)
stops the suite, and every fleet is torn down on the way out. Caches start empty in every run: there
is no warm-up traffic, only the fleet's readiness probe, which uses reserved ids and keys and is not
part of the results.
"""

from __future__ import annotations

import asyncio
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import orjson

import stargate
from stargate.bench.driver import Driver, make_session
from stargate.bench.faults import FaultInjector, FaultReport, arrival_args, markdown_section
from stargate.bench.fleet import Fleet, FleetTimeouts
from stargate.bench.plan import RunSpec
from stargate.bench.report import write_report
from stargate.bench.schema import Scenario
from stargate.bench.score import RequestRecord, RunSummary, summarize
from stargate.bench.workload import Workload

Order = Literal["fixed", "interleaved", "randomized"]


class Progress(Protocol):
    """What the runner tells whoever watches it (a rich progress bar, a test, nothing)."""

    def run_started(self, name: str, total: int) -> None: ...
    def request_done(self, name: str, record: RequestRecord) -> None: ...
    def run_finished(self, name: str, error: str | None) -> None: ...


class SilentProgress:
    def run_started(self, name: str, total: int) -> None:
        pass

    def request_done(self, name: str, record: RequestRecord) -> None:
        pass

    def run_finished(self, name: str, error: str | None) -> None:
        pass


@dataclass(frozen=True)
class PlannedRun:
    name: str
    spec: RunSpec
    repeat: int
    run_dir: Path


@dataclass
class RunOutcome:
    planned: PlannedRun
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    error: str | None = None
    faults: FaultReport | None = None
    pylons_in_path: bool = True  # False: a router straight to the engines, scored over them


@dataclass(frozen=True)
class SuiteResult:
    out_dir: Path
    outcomes: tuple[RunOutcome, ...]
    summaries: tuple[RunSummary, ...]
    report_path: Path


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "run"


def plan_runs(specs: Sequence[RunSpec], out_dir: Path, repeats: int, order: Order,
              seed: int = 0) -> list[PlannedRun]:
    """Run order: ``fixed`` A B, A B; ``interleaved`` A B, B A, A B (cancels linear drift);
    ``randomized`` a seeded shuffle per repeat."""
    rng = random.Random(seed)
    planned: list[PlannedRun] = []
    for rep in range(1, repeats + 1):
        batch = list(specs)
        if order == "interleaved" and rep % 2 == 0:
            batch.reverse()
        elif order == "randomized":
            rng.shuffle(batch)
        for spec in batch:
            name = spec.name if repeats == 1 else f"{spec.name} #{rep}"
            suffix = "" if repeats == 1 else f"-r{rep}"
            planned.append(PlannedRun(name, spec, rep, out_dir / f"run-{slug(spec.name)}{suffix}"))
    return planned


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    with path.open("wb") as sink:
        for record in records:
            sink.write(orjson.dumps(record))
            sink.write(b"\n")


async def execute_run(scenario: Scenario, workload: Workload, planned: PlannedRun, progress: Progress,
                      timeouts: FleetTimeouts | None = None) -> RunOutcome:
    """One run; failures become ``outcome.error`` (cancellation propagates after teardown)."""
    outcome = RunOutcome(planned)
    progress.run_started(planned.name, len(workload.requests))
    planned.run_dir.mkdir(parents=True, exist_ok=True)
    (planned.run_dir / "run-info.json").write_bytes(orjson.dumps(
        {"name": planned.name, "algorithm": planned.spec.name, "repeat": planned.repeat,
         "lb_config": planned.spec.lb_config, "pylon_args": planned.spec.pylon_args},
        option=orjson.OPT_INDENT_2))
    driver: Driver | None = None
    try:
        async with Fleet(scenario, planned.spec, planned.run_dir, timeouts,
                         engine_args=arrival_args(scenario, planned.run_dir)) as fleet:
            await fleet.scrape("before")
            (planned.run_dir / "fleet.json").write_bytes(orjson.dumps(
                {"stargates": fleet.stargates, "pylons": fleet.pylons, "engines": fleet.engines},
                option=orjson.OPT_INDENT_2))
            async with make_session(workload.max_concurrency) as session:
                driver = Driver(session, fleet.stargate_urls, planned.name,
                                on_record=lambda r: progress.request_done(planned.name, r))
                outcome.records, outcome.duration_s, outcome.faults = await replay_with_faults(
                    scenario, workload, fleet, driver, planned.run_dir)
            await fleet.scrape("after")
    except Exception as exc:  # one failed run must not end the suite
        outcome.error = f"{type(exc).__name__}: {exc}"
        (planned.run_dir / "error.txt").write_text(outcome.error + "\n")
    finally:
        if not outcome.records and driver is not None:  # interrupted: keep what finished
            outcome.records = sorted(driver.records, key=lambda r: r.index)
        write_records(planned.run_dir / "requests.jsonl", outcome.records)
        progress.run_finished(planned.name, outcome.error)
    return outcome


async def replay_with_faults(scenario: Scenario, workload: Workload, fleet: Fleet, driver: Driver,
                             run_dir: Path) -> tuple[list[RequestRecord], float, FaultReport | None]:
    """The replay, with the scenario's degradation actions fired on ``fleet`` meanwhile."""
    async with FaultInjector(scenario, workload, fleet, lambda: len(driver.records)) as injector:
        started = time.perf_counter()
        records = await driver.replay(workload)
        duration_s = time.perf_counter() - started
    faults = injector.report(records, run_dir) if injector.actions else None
    return records, duration_s, faults


def append_fault_section(report: Path, outcomes: Sequence[RunOutcome]) -> None:
    """The ``## Faults`` section of ``report.md``, when a run injected faults."""
    rows = [(o.planned.name, o.faults) for o in outcomes if o.faults is not None]
    if rows:
        with report.open("a", encoding="utf-8") as sink:
            sink.write(markdown_section(rows))


async def run_suite(scenario: Scenario, workload: Workload, out_dir: Path, *, runs: Sequence[RunSpec],
                    repeats: int = 1, order: Order = "fixed", seed: int = 0,
                    progress: Progress | None = None, timeouts: FleetTimeouts | None = None,
                    slo_ttft_ms: float | None = None, argv: Sequence[str] = ()) -> SuiteResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_metadata(out_dir / "run-metadata.json", argv)
    watcher = progress or SilentProgress()
    outcomes: list[RunOutcome] = []
    for planned in plan_runs(runs, out_dir, repeats, order, seed):
        outcomes.append(await execute_run(scenario, workload, planned, watcher, timeouts))
    write_runs(out_dir / "runs.json", outcomes)
    summaries = [summarize_outcome(o, scenario, slo_ttft_ms) for o in outcomes]
    records_by_run = {o.planned.name: o.records for o in outcomes}
    report = await asyncio.to_thread(write_report, out_dir, scenario, summaries, records_by_run)
    append_fault_section(report, outcomes)
    return SuiteResult(out_dir, tuple(outcomes), tuple(summaries), report)


def write_runs(path: Path, outcomes: Sequence[RunOutcome]) -> None:
    """``runs.json``: status, error and request count of every run (``algorithm``: its router label
    under ``compare``)."""
    path.write_bytes(orjson.dumps(
        [{"name": o.planned.name, "algorithm": o.planned.spec.name, "repeat": o.planned.repeat,
          "run_dir": o.planned.run_dir.name, "status": "failed" if o.error else "ok", "error": o.error,
          "requests": len(o.records), "duration_s": o.duration_s} for o in outcomes],
        option=orjson.OPT_INDENT_2))


def summarize_outcome(outcome: RunOutcome, scenario: Scenario, slo_ttft_ms: float | None) -> RunSummary:
    summary = summarize(outcome.planned.name, outcome.records, scenario, outcome.duration_s, slo_ttft_ms,
                        pylons_in_path=outcome.pylons_in_path)
    (outcome.planned.run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


KNOWN_LIMITATIONS = (
    "all processes share one host: the bench client competes with the fleet for CPU",
    "the mock engines model service time; absolute latencies are not those of real engines",
    "metrics are scraped once before and once after each replay, not continuously",
)


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=5,
                              check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_facts(package_dir: Path) -> dict[str, object]:
    """sha, branch and dirty of the checkout whose git tracks ``package_dir``: the code benchmarked,
    wherever the bench runs from. An installed copy (untracked, or outside any work tree) has none:
    ``unknown`` and dirty ``None``, never a clean claim."""
    if _git(package_dir, "ls-files", "--error-unmatch", "__init__.py") is None:
        return {"sha": "unknown", "branch": "unknown", "dirty": None}
    status = _git(package_dir, "status", "--porcelain")
    return {"sha": _git(package_dir, "rev-parse", "HEAD") or "unknown",
            "branch": _git(package_dir, "rev-parse", "--abbrev-ref", "HEAD") or "unknown",
            "dirty": None if status is None else status != ""}  # fmt: skip


def _cgroup_cpu_limit() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def run_metadata(argv: Sequence[str]) -> dict[str, object]:
    """Host and build facts that qualify the numbers (spec §5.4); unreadable facts are ``unknown``
    (a dirty flag ``None``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = _cgroup_cpu_limit()
    usable = min(cpus, limit) if limit is not None else float(cpus)
    try:
        load1: float | None = os.getloadavg()[0]
    except OSError:
        load1 = None
    checks = [{"name": "load_1m_below_0.75_cpus",
               "ok": None if load1 is None else load1 <= 0.75 * usable,
               "detail": f"load {load1} on {usable:g} usable CPUs"}]
    return {
        "schema_version": 1,
        "tier": "local_process",
        "driver_mode": "local_process",
        "argv": list(argv),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cwd": str(Path.cwd()),
        "git": git_facts(Path(stargate.__file__).resolve().parent),
        "host": {"hostname": platform.node(), "uname": " ".join(platform.uname()),
                 "cpu_count": os.cpu_count(), "affinity_cpus": cpus, "cgroup_cpu_limit": limit,
                 "loadavg_1m": load1},
        "preflight": checks,
        "known_limitations": list(KNOWN_LIMITATIONS),
    }


def write_run_metadata(path: Path, argv: Sequence[str]) -> None:
    path.write_bytes(orjson.dumps(run_metadata(argv), option=orjson.OPT_INDENT_2))
