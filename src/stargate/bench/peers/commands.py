"""The ``compare`` and ``overhead`` subcommands of ``stargate-bench`` (parsers and bodies)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from stargate.bench.console import (
    EXIT_FAILED,
    EXIT_OK,
    RichProgress,
    positive,
    positive_float,
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
from stargate.bench.runner import Order
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError

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


def add_parsers(sub: Any) -> None:
    compare = sub.add_parser("compare", help="Stargate algorithms and other routers on identical fleets")
    compare.add_argument("--scenario", required=True, help="scenario file, or the name of one in benches/")
    compare.add_argument(
        "--routers",
        default=DEFAULT_ROUTERS,
        help="comma list: stargate:<algorithm entry or name>, sglang:<cache_aware|"
        "power_of_two|round_robin>, vllm:<cache_aware|consistent_hash|round_robin>, direct",
    )
    compare.add_argument(
        "--out", type=Path, default=None, help="output directory (default .bench-out/compare-…)"
    )
    compare.add_argument(
        "--seed", type=int, default=None, help="workload seed (default: the scenario's, else 0)"
    )
    compare.add_argument("--request-count", type=positive, default=None, help="override request_count")
    compare.add_argument("--repeats", type=positive, default=1, help="runs per router (default 1)")
    compare.add_argument("--order", choices=["fixed", "interleaved", "randomized"], default="interleaved")
    compare.add_argument("--slo-ttft-ms", type=positive_float, default=None, help="TTFT SLO for goodput")
    compare.add_argument(
        "--sglang-as-shipped",
        action="store_true",
        help="run sglang-router without the TCP_NODELAY accept shim (adds ~40 ms per streamed request)",
    )

    overhead = sub.add_parser("overhead", help="latency and CPU one routing hop adds, against direct")
    overhead.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    overhead.add_argument("--stargate-only", action="store_true", help="direct, stargate and stargate+pylon")
    overhead.add_argument(
        "--concurrency", type=_positive_ints, default=(1, 32), help="comma list (default 1,32)"
    )
    overhead.add_argument("--requests", type=positive, default=2000, help="requests per measurement")
    overhead.add_argument("--duration", type=positive_float, default=20.0, help="seconds cap per measurement")
    overhead.add_argument("--warmup", type=positive, default=50, help="unmeasured requests first")
    overhead.add_argument("--repeats", type=positive, default=1, help="pairs per target (default 1)")
    overhead.add_argument("--install-peers", action="store_true", help="install missing peer routers first")
    overhead.add_argument(
        "--out", type=Path, default=None, help="output directory (default .bench-out/overhead)"
    )


def compare_command(console: Console, args: argparse.Namespace, argv: list[str]) -> int:
    base = prepare_scenario(args.scenario, None, args.request_count)
    options = PeerOptions(install=True, nodelay=not args.sglang_as_shipped)
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
