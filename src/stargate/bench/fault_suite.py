"""``stargate-bench faults``: the fault suite, one loopback run per fault scenario, one table.

The four scenarios (``benches/fault-*.yaml``) share a fleet and a workload and differ in the fault on
backend-0: engine kill (SIGKILL), engine hang (SIGSTOP for 8 s), Pylon kill, Pylon freeze. Per fault the
table gives requests sent, failed, failed without reaching an engine (goal 0) and how long the faulty
backend stayed routable (goal at most 3 s), one row per run (``--repeats``: the window in which a
fault can cost requests is short, so a single run says little). ``--strict`` turns a missed goal into
exit status 1. ``--algorithm recommended`` runs the recommended deployment instead (what the README
quickstart runs), unless a scenario has an entry of that name.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from stargate.bench import plan
from stargate.bench.console import EXIT_FAILED, EXIT_OK, resolve_scenario, run_async
from stargate.bench.faults import ActionReport, FaultReport, routable_cell
from stargate.bench.peers.compare import RECOMMENDED, recommended_run
from stargate.bench.plan import RunSpec
from stargate.bench.runner import run_suite
from stargate.bench.schema import Scenario, load_scenario
from stargate.bench.suite import markdown_table
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError
from stargate.flags import FlagSet, positive_int

FAULT_SCENARIOS = ("fault-engine-kill", "fault-engine-hang", "fault-pylon-kill", "fault-pylon-freeze")
ROUTABLE_GOAL_S = 3.0
SUMMARY_FILE = "faults.md"


def add_parser(sub: Any, env: Mapping[str, str]) -> None:
    """Adds ``faults`` to the ``stargate-bench`` sub-commands (``sub`` is argparse's subparsers action)."""
    help_text = "the fault suite: engine kill/hang, Pylon kill/freeze on loopback"
    a = FlagSet(sub.add_parser("faults", help=help_text), env).add
    a("--scenarios", default=",".join(FAULT_SCENARIOS), help="comma list of fault scenarios")
    a("--algorithm", default=None,
      help="algorithm of each scenario to run, or 'recommended' for the recommended deployment "
           "(default: its first)")  # fmt: skip
    a("--repeats", type=positive_int, default=1, help="runs per fault, a row each")
    a("--out", type=Path, default=Path(".bench-out/faults"), help="output directory")
    a("--strict", action="store_true", help="exit 1 when a fault misses a goal")


def goals_met(report: FaultReport) -> bool:
    return report.failed_before_engine == 0 and all(_routable_ok(a) for a in report.actions)


def _routable_ok(action: ActionReport) -> bool:
    return action.left_routing and action.routable_s is not None and action.routable_s <= ROUTABLE_GOAL_S


def summary_rows(results: Sequence[tuple[str, FaultReport | None, str | None]]) -> list[list[str]]:
    rows = []
    for name, report, error in results:
        if report is None:
            rows.append([name, "-", "-", "-", "-", f"run failed: {error or 'no fault fired'}"])
            continue
        routable = ", ".join(routable_cell(a) for a in report.actions) or "-"
        rows.append([name, str(report.sent), str(report.failed), str(report.failed_before_engine), routable,
                     "yes" if goals_met(report) else "no"])
    return rows


HEADERS = ["Fault", "Sent", "Failed", "Failed before engine (goal 0)",
           f"Routable s (goal <= {ROUTABLE_GOAL_S:g})", "Goals met"]


def markdown(rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(markdown_table(HEADERS, rows)) + "\n"


def _single_algorithm(sc: Scenario, name: str | None) -> Scenario:
    if not sc.algorithms:
        raise ConfigError("a fault scenario needs an algorithm", path="$.algorithms")
    return sc.select_algorithms([name or sc.algorithms[0].name])


def suite_run(sc: Scenario, name: str | None) -> tuple[Scenario, RunSpec]:
    """The scenario narrowed to the run it makes: its ``name`` entry (default its first), or the
    recommended deployment on its fleet when ``name`` is ``recommended`` and it has no such entry."""
    if name == RECOMMENDED and all(entry.name != RECOMMENDED for entry in sc.algorithms):
        return sc, recommended_run(sc)
    sc = _single_algorithm(sc, name)
    return sc, plan.runs(sc)[0]


async def run_fault_suite(names: Sequence[str], out: Path, algorithm: str | None, argv: Sequence[str],
                          repeats: int = 1) -> list[tuple[str, FaultReport | None, str | None]]:
    scenarios = [suite_run(load_scenario(resolve_scenario(n)), algorithm) for n in names]
    results: list[tuple[str, FaultReport | None, str | None]] = []
    for name, (sc, spec) in zip(names, scenarios, strict=True):
        seed = sc.effective_seed()
        result = await run_suite(sc, build_workload(sc, seed), out / name, runs=[spec], seed=seed,
                                 repeats=repeats, argv=argv)
        for outcome in result.outcomes:
            label = name if repeats == 1 else f"{name} #{outcome.planned.repeat}"
            results.append((label, outcome.faults, outcome.error))
    return results


def faults_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    if not names:
        raise ConfigError("no fault scenarios given", path="--scenarios")
    with console.status("running the fault suite (about 40 s per fault)"):
        results = run_async(run_fault_suite(names, args.out, args.algorithm, argv, args.repeats))
    rows = summary_rows(results)
    table = Table(*HEADERS, title=f"fault suite ({args.out})")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    (args.out / SUMMARY_FILE).write_text(markdown(rows), encoding="utf-8")
    console.print(f"summary: {args.out / SUMMARY_FILE}; per fault: {args.out}/<fault>/report.md",
                  highlight=False)
    failed = any(report is None for _, report, _ in results)
    missed = any(report is not None and not goals_met(report) for _, report, _ in results)
    return EXIT_FAILED if failed or (args.strict and missed) else EXIT_OK
