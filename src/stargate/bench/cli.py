"""The ``stargate-bench`` console script: run, compare, overhead, faults, summarize, demo, serve,
list-scenarios, validate.

Exit status: 0 every run succeeded, 1 at least one run failed (the report is still written),
2 bad usage or a bad scenario file, 130 interrupted (every process was stopped first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from stargate.bench.runner import Order, SuiteResult, run_suite
from stargate.bench.scenario import Scenario, load_scenario
from stargate.bench.score import RequestRecord
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError, StargateError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

T = TypeVar("T")


def benches_dir() -> Path:
    """``benches/`` of the source tree this package runs from, else of the current directory."""
    tree = Path(__file__).resolve().parents[3] / "benches"
    return tree if tree.is_dir() else Path.cwd() / "benches"


def scenario_files(directory: Path) -> dict[str, Path]:
    """Scenario stem → file; ``.yaml`` wins over ``.yml`` on a stem clash."""
    found: dict[str, Path] = {}
    for suffix in (".yml", ".yaml"):
        for path in sorted(directory.glob(f"*{suffix}")):
            found[path.stem] = path
    return dict(sorted(found.items()))


def resolve_scenario(value: str) -> Path:
    """A path to a file, or the stem (with or without extension) of a scenario in ``benches/``."""
    path = Path(value)
    if path.is_file():
        return path
    if not value.strip() or "/" in value or "\\" in value:
        raise ConfigError(f"no such scenario file: {value!r}", path="--scenario")
    stem = value.removesuffix(".yaml").removesuffix(".yml")
    known = scenario_files(benches_dir())
    if stem in known:
        return known[stem]
    available = ", ".join(known) or "none"
    raise ConfigError(f"unknown scenario {value!r}; available: {available}", path="--scenario")


class RichProgress:
    """A progress bar per run: requests done of the planned total."""

    def __init__(self, console: Console) -> None:
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("{task.fields[state]}"), TimeElapsedColumn(), console=console)
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> RichProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def run_started(self, name: str, total: int) -> None:
        self._tasks[name] = self._bar.add_task(name, total=total, state="starting fleet")

    def request_done(self, name: str, record: RequestRecord) -> None:
        self._bar.update(self._tasks[name], advance=1, state="replaying")

    def run_finished(self, name: str, error: str | None) -> None:
        task = self._tasks[name]
        state = "[red]failed[/red]" if error else "[green]done[/green]"
        done = next(t.completed for t in self._bar.tasks if t.id == task)
        # A duration-capped replay sends fewer requests than planned: the bar ends full anyway.
        self._bar.update(task, state=state, total=None if error else max(done, 1), completed=done)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stargate-bench", description="Compare routing algorithms on a loopback fleet.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="run a scenario: one fresh fleet per algorithm, then a report")
    run.add_argument("--scenario", required=True, help="scenario file, or the name of one in benches/")
    run.add_argument("--out", type=Path, default=None, help="output directory (default .bench-out/<name>)")
    run.add_argument("--seed", type=int, default=None, help="workload seed (default: the scenario's, else 0)")
    run.add_argument("--algorithms", default=None, help="comma list of algorithm names to run (config order)")
    run.add_argument("--request-count", type=_positive, default=None, help="override request_count")
    run.add_argument("--repeats", type=_positive, default=1, help="runs per algorithm (default 1)")
    run.add_argument("--order", choices=["fixed", "interleaved", "randomized"], default="interleaved",
                     help="order of algorithms across repeats (default interleaved)")
    run.add_argument("--slo-ttft-ms", type=_positive_float, default=None,
                     help="TTFT SLO for attainment and goodput columns")

    demo = sub.add_parser("demo", help="1 Stargate, 4 Pylons, 4 mock engines, a 30 s mixed workload")
    demo.add_argument("--serve", action="store_true", help="keep the fleet up afterwards until Ctrl-C")
    demo.add_argument("--duration", type=_positive_float, default=30.0, help="workload seconds (default 30)")
    demo.add_argument("--no-workload", action="store_true", help="with --serve: skip the workload")
    demo.add_argument("--scenario", default=None, help="scenario to use instead of benches/demo.yaml")
    demo.add_argument("--out", type=Path, default=None, help="output directory (default .bench-out/demo)")

    sub.add_parser("list-scenarios", help="list the scenarios in benches/")

    summarize = sub.add_parser(
        "summarize", help="one table across finished compare runs: <dir>/<scenario>/comparison.json"
    )
    summarize.add_argument("dir", type=Path, help="directory holding one compare output per scenario")

    validate = sub.add_parser("validate", help="check a scenario file without starting anything")
    validate.add_argument("--scenario", required=True, help="scenario file, or the name of one in benches/")

    from stargate.bench.fault_suite import add_parser as add_faults_parser
    from stargate.bench.peers.commands import add_parsers
    from stargate.bench.serve import add_parser as add_serve_parser

    add_parsers(sub, _positive, _positive_float)
    add_serve_parser(sub, _positive)
    add_faults_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # Piped or redirected output keeps whole table rows and markdown lines instead of rich's 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=400, soft_wrap=True)
    try:
        if args.command == "list-scenarios":
            return list_scenarios(console)
        if args.command == "validate":
            return validate(console, args.scenario)
        if args.command == "summarize":
            return summarize_command(console, args.dir)
        if args.command == "run":
            return run_command(console, args, list(sys.argv if argv is None else argv))
        if args.command == "faults":
            from stargate.bench.fault_suite import faults_command

            return faults_command(console, args, list(sys.argv if argv is None else argv))
        if args.command in ("compare", "overhead"):
            from stargate.bench.peers import commands

            handler = commands.compare_command if args.command == "compare" else commands.overhead_command
            return handler(console, args, list(sys.argv if argv is None else argv))
        if args.command == "serve":
            from stargate.bench.serve import serve

            return asyncio.run(serve(args))
        from stargate.bench.demo import demo_command

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


def list_scenarios(console: Console) -> int:
    from rich.table import Table

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
    from stargate.bench.suite import write_summary

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
                  f"{len(sc.engines())} engines, {sc.stargates.count} Stargate(s), "
                  f"algorithms: {', '.join(a.name for a in sc.algorithms) or 'none'})", highlight=False)
    return EXIT_OK


def prepare_scenario(value: str, algorithms: str | None, request_count: int | None) -> Scenario:
    sc = load_scenario(resolve_scenario(value))
    if algorithms is not None:
        sc = sc.select_algorithms([name.strip() for name in algorithms.split(",") if name.strip()])
    if request_count is not None:
        base = sc.base_dir
        sc = sc.model_copy(update={"request_count": request_count})
        sc._base_dir = base
    return sc


def run_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    sc = prepare_scenario(args.scenario, args.algorithms, args.request_count)
    runs = sc.runs()
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


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def results_table(result: SuiteResult) -> Table:
    table = Table(title=f"results ({result.out_dir})")
    for column in ("run", "status", "ok %", "req/s", "TTFT avg", "TTFT p95", "TTFT p99", "TTLT p95",
                   "cache hit", "balance", "cap. balance", "failed"):
        table.add_column(column, justify="left" if column in ("run", "status") else "right")
    for outcome, summary in zip(result.outcomes, result.summaries, strict=True):
        status = "[red]failed[/red]" if outcome.error else "[green]ok[/green]"
        hit = None if summary.cache_hit_rate is None else summary.cache_hit_rate * 100
        table.add_row(
            summary.run, status, _fmt(summary.success_rate * 100, "%", 1),
            _fmt(summary.requests_per_second, digits=2),
            _fmt(summary.avg_ttft_ms, " ms"), _fmt(summary.p95_ttft_ms, " ms"),
            _fmt(summary.p99_ttft_ms, " ms"), _fmt(summary.p95_ttlt_ms, " ms"), _fmt(hit, "%", 1),
            _fmt(summary.equal_balance, digits=3), _fmt(summary.capacity_balance, digits=3),
            str(summary.request_count - summary.success_count),
        )
    return table


def print_result(console: Console, result: SuiteResult) -> int:
    console.print(results_table(result))
    for outcome in result.outcomes:
        if outcome.error:
            console.print(f"[red]{outcome.planned.name} failed:[/red] {outcome.error}", highlight=False)
    console.print(f"report: {result.report_path}", highlight=False)
    return EXIT_FAILED if any(o.error for o in result.outcomes) else EXIT_OK


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; SIGTERM cancels it like Ctrl-C, so every ``finally`` (fleet teardown) runs."""

    async def guarded() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            if task is not None:
                loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await coro
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGTERM)

    return asyncio.run(guarded())
