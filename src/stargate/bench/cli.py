"""The ``stargate-bench`` console script: run, compare, overhead, faults, fuzz, summarize, demo, serve,
gen-trace, list-scenarios, validate.

Exit status: see :mod:`stargate.bench.console`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from stargate.bench import fault_suite, fuzz, plan, serve, tracegen
from stargate.bench.console import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    RichProgress,
    add_replay_flags,
    benches_dir,
    command,
    prepare_scenario,
    print_result,
    resolve_scenario,
    run_async,
    scenario_files,
)
from stargate.bench.demo import demo_command
from stargate.bench.peers import commands
from stargate.bench.runner import Order, run_suite
from stargate.bench.schema import load_scenario
from stargate.bench.suite import write_summary
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError, StargateError
from stargate.flags import positive_float
from stargate.wire.runner import raise_open_files_limit


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Every subcommand declares its flags through ``FlagSet`` (``env``: the process environment)."""
    environ = env or {}
    parser = Parser(prog="stargate-bench", description="Compare routing algorithms on a loopback fleet.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    run = command(sub, "run", "run a scenario: one fresh fleet per algorithm, then a report", environ)
    add_replay_flags(run, out_help="output directory (default .bench-out/<name>)")
    run.add("--algorithms", default=None, help="comma list of algorithm names to run (config order)")

    demo = command(sub, "demo", "1 Stargate, 4 Pylons, 4 mock engines, a 30 s mixed workload", environ).add
    demo("--serve", action="store_true", help="keep the fleet up afterwards until Ctrl-C")
    demo("--duration", type=positive_float, default=30.0, help="workload seconds")
    demo("--no-workload", action="store_true", help="with --serve: skip the workload")
    demo("--scenario", default=None, help="scenario to use instead of benches/demo.yaml")
    demo("--out", type=Path, default=None, help="output directory (default .bench-out/demo)")

    command(sub, "list-scenarios", "list the scenarios in benches/", environ)
    summary_help = "one table across finished compare runs: <dir>/<scenario>/comparison.json"
    summarize = command(sub, "summarize", summary_help, environ)
    summarize.add("dir", type=Path, help="directory holding one compare output per scenario")
    validate = command(sub, "validate", "check a scenario file without starting anything", environ)
    validate.add("--scenario", required=True, help="scenario file, or the name of one in benches/")

    commands.add_parsers(sub, environ)
    serve.add_parser(sub, environ)
    fault_suite.add_parser(sub, environ)
    fuzz.add_parser(sub, environ)
    tracegen.add_parser(sub, environ)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(os.environ).parse_args(sys.argv[1:] if argv is None else argv)
    raise_open_files_limit()  # its clients, and the fleet processes it starts, open many sockets
    # Piped or redirected output keeps whole table rows and markdown lines instead of rich's 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=400, soft_wrap=True)
    try:
        _check_out(args)
        if args.command == "list-scenarios":
            return list_scenarios(console)
        if args.command == "validate":
            return validate(console, args.scenario)
        if args.command == "summarize":
            return summarize_command(console, args.dir)
        if args.command == "run":
            return run_command(console, args, list(sys.argv if argv is None else argv))
        if args.command == "faults":
            return fault_suite.faults_command(console, args, list(sys.argv if argv is None else argv))
        if args.command == "fuzz":
            return fuzz.fuzz_command(console, args)
        if args.command in ("compare", "overhead"):
            handler = commands.compare_command if args.command == "compare" else commands.overhead_command
            return handler(console, args, list(sys.argv if argv is None else argv))
        if args.command == "serve":
            return asyncio.run(serve.serve(args))
        if args.command == "gen-trace":
            return tracegen.gen_trace_command(console, args)
        return demo_command(console, args)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc.describe()}", highlight=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every fleet process was stopped[/yellow]")
        return EXIT_INTERRUPTED
    except StargateError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return EXIT_FAILED


def _check_out(args: argparse.Namespace) -> None:
    """An ``--out`` it cannot write to is a usage error before any fleet starts, not a traceback
    after one did."""
    out: Path | None = getattr(args, "out", None)
    if out is None:
        return
    directory = out.parent if args.command == "gen-trace" else out  # gen-trace writes one file
    if args.command == "gen-trace" and (out.is_dir() or not out.name):
        raise ConfigError(f"{str(out) or repr('')} is a directory, not a file to write", path="--out")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise ConfigError(f"cannot write to {directory}: {exc.strerror or exc}", path="--out") from exc


def list_scenarios(console: Console) -> int:
    files = scenario_files(benches_dir())
    if not files:
        console.print(f"no scenarios found in {benches_dir()}")
        return EXIT_OK
    table = Table("Scenario", "Requests", "Backends", "Stargates", "Tags", "Algorithms")
    for stem, path in files.items():
        try:
            sc = load_scenario(path)
        except ConfigError as exc:
            table.add_row(stem, "-", "-", "-", "-", f"[red]invalid: {exc.describe()}[/red]")
            continue
        table.add_row(stem, str(sc.request_count), str(sc.backends.count), str(sc.stargates.count),
                      ",".join(sc.metadata.tags), ",".join(a.name for a in sc.algorithms))
    console.print(table)
    return EXIT_OK


def summarize_command(console: Console, root: Path) -> int:
    if not any(root.glob("*/comparison.json")):
        raise ConfigError(f"no <scenario>/comparison.json under {root}", path="dir")
    out, text = write_summary(root)
    console.print(text, highlight=False, markup=False)
    console.print(f"summary: {out}", highlight=False)
    return EXIT_OK


def validate(console: Console, value: str) -> int:
    path = resolve_scenario(value)
    sc = load_scenario(path)
    build_workload(sc)
    console.print(f"{path}: valid ({sc.request_count} requests, {sc.backends.count} backends, "
                  f"{len(plan.engines(sc))} engines, {sc.stargates.count} Stargate(s), "
                  f"algorithms: {', '.join(a.name for a in sc.algorithms) or 'none'})", highlight=False)
    return EXIT_OK


def run_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    sc = prepare_scenario(args.scenario, args.algorithms, args.request_count, args.mock_batching)
    runs = plan.runs(sc)
    if not runs:
        raise ConfigError("the scenario has no algorithms to run", path="$.algorithms")
    seed = sc.effective_seed(args.seed)
    workload = build_workload(sc, seed)
    out_dir = args.out or Path(".bench-out") / sc.slug
    order: Order = args.order
    with RichProgress(console) as progress:
        result = run_async(run_suite(sc, workload, out_dir, runs=runs, repeats=args.repeats, order=order,
                                     seed=seed, progress=progress, slo_ttft_ms=args.slo_ttft_ms,
                                     argv=argv))
    return print_result(console, result)
