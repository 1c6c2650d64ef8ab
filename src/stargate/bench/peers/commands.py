"""The ``compare`` and ``overhead`` subcommands of ``stargate-bench`` (parsers and bodies)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from stargate.bench.console import (
    EXIT_FAILED,
    EXIT_OK,
    RichProgress,
    add_replay_flags,
    command,
    prepare_scenario,
    print_result,
    run_async,
)
from stargate.bench.overhead import (
    TARGETS,
    OverheadOptions,
    available_targets,
    markdown_table,
    run_overhead,
    summarize_overhead,
    write_overhead,
)
from stargate.bench.peers.compare import PeerOptions, comparable_scenario, resolve_routers, run_compare
from stargate.bench.peers.install import DEFAULT_PEERS_ROOT, PEERS_DIR_ENV
from stargate.bench.runner import Order
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError
from stargate.flags import FlagSet, positive_float, positive_int

DEFAULT_ROUTERS = "stargate:power-of-n,sglang:cache_aware,vllm:consistent_hash,direct"


def _positive_ints(value: str) -> tuple[int, ...]:
    try:
        numbers = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {value!r}"
        ) from None
    if not numbers or any(n <= 0 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {value!r}")
    return numbers


def _peers_dir(raw: str) -> Path | None:
    return Path(raw).expanduser() if raw.strip() else None


def _add_peers_dir(flags: FlagSet) -> None:
    flags.add("--peers-dir", env_var=PEERS_DIR_ENV, type=_peers_dir, default=None,
              help=f"root of the peer routers' venvs (default {DEFAULT_PEERS_ROOT})")


def add_parsers(sub: Any, env: Mapping[str, str]) -> None:
    compare = command(sub, "compare", "Stargate algorithms and other routers on identical fleets", env)
    add_replay_flags(compare, out_help="output directory (default .bench-out/compare-…)")
    compare.add(
        "--routers",
        default=DEFAULT_ROUTERS,
        help="comma list: stargate:<algorithm entry or name>, sglang:<cache_aware|"
        "power_of_two|round_robin>, vllm:<cache_aware|consistent_hash|round_robin>, direct",
    )
    compare.add(
        "--sglang-as-shipped",
        action="store_true",
        help="run sglang-router without the TCP_NODELAY accept shim (adds ~40 ms per streamed request)",
    )
    _add_peers_dir(compare)

    overhead = command(sub, "overhead", "latency and CPU one routing hop adds, against direct", env)
    a = overhead.add
    a("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    a("--stargate-only", action="store_true", help="direct, stargate and stargate+pylon")
    a("--concurrency", type=_positive_ints, default="1,32", help="comma list")
    a("--requests", type=positive_int, default=2000, help="requests per measurement")
    a("--duration", type=positive_float, default=20.0, help="seconds cap per measurement")
    a("--warmup", type=positive_int, default=50, help="unmeasured requests first")
    a("--repeats", type=positive_int, default=1, help="pairs per target")
    a("--install-peers", action="store_true", help="install missing peer routers first")
    a("--out", type=Path, default=None, help="output directory (default .bench-out/overhead)")
    _add_peers_dir(overhead)


def compare_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    base = prepare_scenario(args.scenario, None, args.request_count, args.mock_batching)
    options = PeerOptions(install=True, nodelay=not args.sglang_as_shipped, root=args.peers_dir)
    choices = resolve_routers(base, args.routers, options)
    scenario = comparable_scenario(base, choices)
    if scenario is not base:
        console.print("mock.kv_mode: prefix for every run (peer routers drop the cache-affinity header)")
    seed = scenario.effective_seed(args.seed)
    workload = build_workload(scenario, seed)
    out_dir = args.out or Path(".bench-out") / f"compare-{scenario.slug}"
    order: Order = args.order
    with RichProgress(console) as progress:
        result = run_async(
            run_compare(
                scenario,
                workload,
                out_dir,
                choices,
                repeats=args.repeats,
                order=order,
                seed=seed,
                progress=progress,
                slo_ttft_ms=args.slo_ttft_ms,
                argv=argv,
                options=options,
            )
        )
    return print_result(console, result)


def overhead_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    wanted = (
        ["direct", "stargate", "stargate+pylon"]
        if args.stargate_only
        else [t.strip() for t in args.targets.split(",") if t.strip()]
    )
    if "direct" not in wanted:
        wanted.insert(0, "direct")
    options = OverheadOptions(
        concurrencies=args.concurrency,
        requests=args.requests,
        duration_s=args.duration,
        warmup=args.warmup,
        repeats=args.repeats,
        install_peers=args.install_peers,
        peers_root=args.peers_dir,
    )
    targets, skipped = available_targets(wanted, options)
    for line in skipped:
        console.print(f"[yellow]{line}[/yellow]", highlight=False)
    if len(targets) < 2:
        raise ConfigError("nothing to compare with direct", path="--targets")
    out_dir = args.out or Path(".bench-out") / "overhead"
    measurements = run_async(run_overhead(targets, out_dir, options))
    rows = summarize_overhead(measurements)
    report = write_overhead(out_dir, measurements, rows, skipped, argv)
    console.print(markdown_table(rows), highlight=False, markup=False)
    console.print(f"report: {report}", highlight=False)
    return EXIT_FAILED if any(r.failed for r in rows) else EXIT_OK
