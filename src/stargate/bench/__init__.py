"""stargate-bench: scenarios, workload generation, a loopback fleet, the replay driver, scoring and reports.

The public entry points of the scenario/scoring half::

    load_scenario(path) -> Scenario            # original schema (spec section 3) plus extensions
    build_workload(scenario, seed) -> Workload # deterministic, one RNG stream per dimension
    summarize(run, records, scenario, duration_s, slo_ttft_ms, *, pylons_in_path) -> RunSummary
    write_report(out_dir, scenario, summaries, records_by_run) -> Path
"""

from __future__ import annotations

from stargate.bench.plan import BackendSpec, EngineSpec, RunSpec
from stargate.bench.report import write_report
from stargate.bench.schema import Scenario, load_scenario
from stargate.bench.score import RequestRecord, RunSummary, summarize
from stargate.bench.workload import PlannedRequest, Workload, build_workload

__all__ = [
    "BackendSpec",
    "EngineSpec",
    "PlannedRequest",
    "RequestRecord",
    "RunSpec",
    "RunSummary",
    "Scenario",
    "Workload",
    "build_workload",
    "load_scenario",
    "summarize",
    "write_report",
]
