"""What the ``stargate-bench`` subcommands share: exit codes, argument types, scenario lookup, progress,
the results table and a SIGTERM-safe runner.

Exit status: 0 every run succeeded, 1 at least one run failed (the report is still written),
2 bad usage or a bad scenario file, 130 interrupted (every process was stopped first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from stargate.bench.runner import SuiteResult
from stargate.bench.schema import MAX_REQUEST_COUNT, Scenario, load_scenario
from stargate.bench.score import RequestRecord
from stargate.errors import ConfigError
from stargate.flags import FlagSet, non_negative_int, positive_float, positive_int
from stargate.mock_engine.timing import BATCHING_MODES, Batching
from stargate.wire.limits import U64_MAX

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


def prepare_scenario(
    value: str, algorithms: str | None, request_count: int | None, batching: Batching | None = None
) -> Scenario:
    """The scenario with the command line's overrides; ``batching`` runs it under another engine model."""
    sc = load_scenario(resolve_scenario(value))
    if algorithms is not None:
        sc = sc.select_algorithms([name.strip() for name in algorithms.split(",") if name.strip()])
    update: dict[str, Any] = {}
    if request_count is not None:
        if request_count > MAX_REQUEST_COUNT:
            raise ConfigError(f"at most {MAX_REQUEST_COUNT}, got {request_count}", path="--request-count")
        update["request_count"] = request_count
    if batching is not None:
        update["mock"] = sc.mock.model_copy(update={"batching": batching})
    if update:
        base = sc.base_dir
        sc = sc.model_copy(update=update)
        sc._base_dir = base
    return sc


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


class Parser(argparse.ArgumentParser):
    """Usage errors exit with :data:`EXIT_USAGE` (argparse's own default is also 2, said here once)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def command(sub: Any, name: str, help: str, env: Mapping[str, str]) -> FlagSet:
    """A subcommand whose flags go through ``FlagSet``: one default each, shown once by ``--help``."""
    return FlagSet(sub.add_parser(name, help=help), env)


def workload_seed(raw: str) -> int:
    """A workload seed, a u64 like the scenario's ``seed``."""
    value = non_negative_int(raw)
    if value > U64_MAX:
        raise argparse.ArgumentTypeError(f"expected at most {U64_MAX}, got {raw!r}")
    return value


def add_replay_flags(flags: FlagSet, *, out_help: str) -> None:
    """The flags ``run`` and ``compare`` share: which scenario, how often, in which order, where to."""
    a = flags.add
    a("--scenario", required=True, help="scenario file, or the name of one in benches/")
    a("--out", type=Path, default=None, help=out_help)
    a("--seed", type=workload_seed, default=None, help="workload seed (default: the scenario's, else 0)")
    a("--request-count", type=positive_int, default=None, help="override request_count")
    a("--repeats", type=positive_int, default=1, help="runs per algorithm or router")
    a("--order", choices=["fixed", "interleaved", "randomized"], default="interleaved",
      help="order of the runs across repeats")
    a("--slo-ttft-ms", type=positive_float, default=None, help="TTFT SLO for attainment and goodput columns")
    a("--mock-batching", choices=BATCHING_MODES, default=None,
      help="override the scenario's mock.batching (the mock engine's scheduler)")


def _fmt(value: float | None, unit: str = "", digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def results_table(result: SuiteResult) -> Table:
    table = Table(title=f"results ({result.out_dir})")
    for column in ("run", "status", "ok %", "req/s", "TTFT avg", "TTFT p95", "TTFT p99", "TTLT p95",
                   "cache hit", "balance", "cap. balance", "in-flight imb", "failed"):
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
            _fmt(summary.inflight_imbalance, digits=2), str(summary.request_count - summary.success_count),
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
    """Run ``coro``; SIGTERM cancels it like Ctrl-C, so every ``finally`` (fleet teardown) runs,
    and either ends as ``KeyboardInterrupt``. Raised outside the loop: a task that ended with it
    was reported "exception never retrieved", with a traceback, when Ctrl-C came during teardown."""

    async def guarded() -> T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            if task is not None:
                loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await coro
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:  # SIGTERM (Ctrl-C is asyncio.run's own KeyboardInterrupt)
        raise KeyboardInterrupt from None
