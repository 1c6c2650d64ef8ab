"""``stargate-bench overhead``: what one routing hop adds, against the client talking to the engine.

One mock engine with a fixed output (no TTFT, near-zero decode delay) serves a closed loop at each
concurrency, bounded by a request count and a time limit. Targets: ``direct`` (no hop),
``stargate`` (Stargate alone: the Pylon registers the engine's own address, so it is out of the data
path), ``stargate+pylon`` (the normal two hops), and each installed peer router (``sglang`` is
sglang-router ``cache_aware``, measured as shipped and with the TCP_NODELAY shim as
``sglang+nodelay``; ``vllm`` is vllm-router ``cache_aware``). Each target gets its own fresh
topology; the run order is ``direct, A, direct, B, direct, …`` and every target is compared with the
mean of the two direct runs beside it (added p50/p99 latency, throughput ratio). Router CPU per
request is the ``utime+stime`` delta of each router process in ``/proc/<pid>/stat`` over the
measured window divided by the requests completed in it.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from stargate.bench.driver import Driver, make_session
from stargate.bench.fleet import Fleet, FleetTimeouts, PylonAddrs
from stargate.bench.peers.adapters import (
    SGLANG,
    VLLM,
    DirectAdapter,
    Kind,
    PeerRouterAdapter,
    RouterAdapter,
    StargateAdapter,
)
from stargate.bench.peers.install import installed
from stargate.bench.peers.tokenizer import write_tokenizer_dir
from stargate.bench.plan import BackendSpec, RunSpec
from stargate.bench.procs import ManagedProcess
from stargate.bench.schema import Scenario, parse_scenario
from stargate.bench.score import RequestRecord
from stargate.bench.workload import PlannedRequest
from stargate.errors import ConfigError
from stargate.mock_engine.peer_compat import TOKENIZER_ENV
from stargate.wire import headers as h

MODEL = "overhead-model"
OUTPUT_TOKENS = 32  # the mock's default length, so the output is fixed even if a router drops max_tokens
INPUT_TEXT = "measure the routing hop " * 8
TARGETS = ("direct", "stargate", "stargate+pylon", "sglang", "sglang+nodelay", "vllm")
PEER_TARGETS = {"sglang": SGLANG, "sglang+nodelay": SGLANG, "vllm": VLLM}
_TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")


def overhead_scenario() -> Scenario:
    return parse_scenario({
        "name": "router-overhead", "model": MODEL, "request_count": 1, "max_concurrency": 1,
        "backends": {"count": 1, "profile": {
            "kv_cache_capacity_tokens": 1_000_000,
            "service_time_ms": {"ttft_mean": 0, "decode_tokens_per_s": 1_000_000.0},
            "registration": {"last_mean_input_tps": 1_000_000.0}}},
        "traffic_pattern": {"kind": "uniform", "input_tokens": {"distribution": "constant", "value": 48},
                            "output_tokens": {"distribution": "constant", "value": OUTPUT_TOKENS},
                            "arrival": {"distribution": "constant", "interval_ms": 0}},
    })


def cpu_ms(pid: int) -> float | None:
    """utime+stime of ``pid`` in milliseconds (None once the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_MS


class _HopFleet(Fleet):
    """Stargate alone: the Pylon advertises the engine's address, so requests skip its relay."""

    def _pylon_proc(self, spec: BackendSpec, suffix: str = "") -> ManagedProcess[PylonAddrs]:
        proc = super()._pylon_proc(spec, suffix)
        engine = self.engines[spec.engine_id].removeprefix("http://")
        proc.argv += ["--http-advertise-addr", engine]
        return proc


@dataclass
class Measurement:
    target: str
    concurrency: int
    slot: int  # position in the run order
    requests: int
    failed: int
    wall_s: float
    p50_ms: float | None
    p99_ms: float | None
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0


def _percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def _request(index: int) -> PlannedRequest:
    body = orjson.dumps({"model": MODEL, "stream": True, "max_tokens": OUTPUT_TOKENS,
                         "messages": [{"role": "user", "content": INPUT_TEXT}]})
    rid = f"overhead-{index}"
    headers = {"content-type": "application/json", h.REQUEST_ID: rid, h.MODEL: MODEL,
               h.INPUT_TOKENS: "48", h.OUTPUT_TOKENS: str(OUTPUT_TOKENS)}
    return PlannedRequest(index=index, request_id=rid, model=MODEL, at_ms=None, session=None, turn=0,
                          input_tokens=48, output_tokens=OUTPUT_TOKENS, routing_key=None,
                          cache_affinity_key=None, headers=headers, body=body, behavior_class="overhead")


async def closed_loop(driver: Driver, concurrency: int, count: int, duration_s: float,
                      start_index: int = 0) -> tuple[list[RequestRecord], float]:
    """``concurrency`` workers send until ``count`` requests were sent or ``duration_s`` passed."""
    records: list[RequestRecord] = []
    next_index = start_index
    deadline = time.perf_counter() + duration_s

    async def worker() -> None:
        nonlocal next_index
        while next_index < start_index + count and time.perf_counter() < deadline:
            req = _request(next_index)
            next_index += 1
            records.append(await driver.send(req, 0.0, 30.0))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - started


@dataclass(frozen=True)
class OverheadOptions:
    concurrencies: tuple[int, ...] = (1, 32)
    requests: int = 2000
    duration_s: float = 20.0
    warmup: int = 50
    repeats: int = 1
    install_peers: bool = False
    peers_root: Path | None = None


def _adapter(target: str, tokenizer_dir: Path, options: OverheadOptions) -> RouterAdapter:
    if target == "direct":
        return DirectAdapter()
    if target in ("stargate", "stargate+pylon"):
        return StargateAdapter(target, pylons_in_path=target == "stargate+pylon")
    kind: Kind = "vllm" if target == "vllm" else "sglang"
    return PeerRouterAdapter(kind, "cache_aware", tokenizer_dir, peers_root=options.peers_root,
                             install=options.install_peers, nodelay=target == "sglang+nodelay")


def available_targets(wanted: Sequence[str], options: OverheadOptions) -> tuple[list[str], list[str]]:
    """Targets to run, and a line for each peer skipped because it is not installed."""
    run, skipped = [], []
    for target in wanted:
        if target not in TARGETS:
            raise ConfigError(f"unknown target {target!r}; expected: {', '.join(TARGETS)}", path="--targets")
        package = PEER_TARGETS.get(target)
        if package is not None and not options.install_peers and not installed(package, options.peers_root):
            skipped.append(f"{target}: skipped, {package.requirement} is not installed "
                           "(run with --install-peers to install it)")
            continue
        run.append(target)
    return run, skipped


async def measure_target(target: str, slot: int, out_dir: Path, options: OverheadOptions,
                         tokenizer_dir: Path, timeouts: FleetTimeouts | None = None) -> list[Measurement]:
    scenario = overhead_scenario()
    spec = RunSpec(target, {"default": "power-of-n"}, [])
    run_dir = out_dir / f"{slot:02d}-{target.replace('+', '-')}"
    fleet_cls = _HopFleet if target == "stargate" else Fleet
    adapter = _adapter(target, tokenizer_dir, options)
    fleet = fleet_cls(scenario, spec, run_dir, timeouts, with_stargate=target.startswith("stargate"),
                      engine_env={TOKENIZER_ENV: str(tokenizer_dir)})
    results: list[Measurement] = []
    async with fleet:
        try:
            await adapter.attach(fleet, fleet.log_dir)
            async with make_session(max(options.concurrencies)) as session:
                driver = Driver(session, adapter.urls, target)
                index = 0
                for concurrency in options.concurrencies:
                    warm, _ = await closed_loop(driver, concurrency, options.warmup, options.duration_s,
                                                index)
                    index += len(warm)
                    pids = adapter.router_pids()
                    before = {name: cpu_ms(pid) for name, pid in pids.items()}
                    records, wall = await closed_loop(driver, concurrency, options.requests,
                                                      options.duration_s, index)
                    after = {name: cpu_ms(pid) for name, pid in pids.items()}
                    index += len(records)
                    results.append(_measurement(target, concurrency, slot, records, wall, before, after))
        finally:
            await adapter.stop()
    return results


def _measurement(target: str, concurrency: int, slot: int, records: list[RequestRecord], wall: float,
                 before: dict[str, float | None], after: dict[str, float | None]) -> Measurement:
    ok = [r for r in records if r.error_class is None]
    latencies = sorted((r.end_s - r.dispatch_s) * 1000.0 for r in ok if r.end_s is not None)
    cpu: dict[str, float] = {}
    for name, start in before.items():
        end = after.get(name)
        if start is not None and end is not None and ok:
            cpu[name] = (end - start) / len(ok)
    return Measurement(target, concurrency, slot, len(ok), len(records) - len(ok), wall,
                       _percentile(latencies, 0.5), _percentile(latencies, 0.99), cpu)


def run_order(targets: Sequence[str], repeats: int) -> list[str]:
    """``direct`` between every pair of other targets, at both ends, over every repeat."""
    others = [t for t in targets if t != "direct"]
    order = ["direct"]
    for _ in range(repeats):
        for target in others:
            order += [target, "direct"]
    return order


async def run_overhead(targets: Sequence[str], out_dir: Path, options: OverheadOptions,
                       timeouts: FleetTimeouts | None = None) -> list[Measurement]:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = await asyncio.to_thread(write_tokenizer_dir, out_dir / "tokenizer", MODEL)
    measurements: list[Measurement] = []
    for slot, target in enumerate(run_order(targets, options.repeats)):
        measurements += await measure_target(target, slot, out_dir, options, tokenizer_dir, timeouts)
    return measurements


@dataclass(frozen=True)
class OverheadRow:
    target: str
    concurrency: int
    p50_ms: float | None
    p99_ms: float | None
    added_p50_ms: float | None
    added_p99_ms: float | None
    throughput: float
    throughput_ratio: float | None
    cpu_ms_per_request: dict[str, float]
    failed: int


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize_overhead(measurements: Sequence[Measurement]) -> list[OverheadRow]:
    """One row per (target, concurrency); every non-direct run is paired with its neighbouring directs."""
    rows: list[OverheadRow] = []
    keys = sorted({(m.concurrency, m.target) for m in measurements},
                  key=lambda k: (k[0], TARGETS.index(k[1]) if k[1] in TARGETS else 99))
    for concurrency, target in keys:
        runs = [m for m in measurements if m.target == target and m.concurrency == concurrency]
        directs = [m for m in measurements if m.target == "direct" and m.concurrency == concurrency]
        added50, added99, ratios = [], [], []
        for run in runs:
            near = [d for d in directs if abs(d.slot - run.slot) == 1] or directs
            base50, base99 = _mean([d.p50_ms for d in near]), _mean([d.p99_ms for d in near])
            base_thr = _mean([d.throughput for d in near])
            if run.p50_ms is not None and base50 is not None:
                added50.append(run.p50_ms - base50)
            if run.p99_ms is not None and base99 is not None:
                added99.append(run.p99_ms - base99)
            if base_thr:
                ratios.append(run.throughput / base_thr)
        cpu_names = sorted({name for run in runs for name in run.cpu_ms_per_request})
        cpu = {name: statistics.fmean(r.cpu_ms_per_request[name] for r in runs
                                      if name in r.cpu_ms_per_request) for name in cpu_names}
        rows.append(OverheadRow(
            target, concurrency, _mean([r.p50_ms for r in runs]), _mean([r.p99_ms for r in runs]),
            None if target == "direct" else _mean(added50), None if target == "direct" else _mean(added99),
            statistics.fmean(r.throughput for r in runs), None if target == "direct" else _mean(ratios),
            cpu, sum(r.failed for r in runs)))
    return rows


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: Sequence[OverheadRow]) -> str:
    lines = ["| target | conc. | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | ratio to direct "
             "| router CPU ms/req | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        cpu = ", ".join(f"{_short(n)} {v:.3f}" for n, v in r.cpu_ms_per_request.items()) or "-"
        if len(r.cpu_ms_per_request) > 1:
            cpu += f" (total {sum(r.cpu_ms_per_request.values()):.3f})"
        lines.append(f"| {r.target} | {r.concurrency} | {_f(r.p50_ms)} | {_f(r.p99_ms)} "
                     f"| {_f(r.added_p50_ms)} | {_f(r.added_p99_ms)} | {r.throughput:.1f} "
                     f"| {_f(r.throughput_ratio, 3)} | {cpu} | {r.failed} |")
    return "\n".join(lines) + "\n"


def _short(name: str) -> str:
    return name.split("-")[0] if name.startswith(("stargate-", "pylon-")) else name


def write_overhead(out_dir: Path, measurements: Sequence[Measurement], rows: Sequence[OverheadRow],
                   skipped: Sequence[str], argv: Sequence[str]) -> Path:
    (out_dir / "overhead.json").write_bytes(orjson.dumps(
        {"argv": list(argv), "measurements": measurements, "rows": rows, "skipped": list(skipped)},
        option=orjson.OPT_INDENT_2))
    report = out_dir / "overhead.md"
    text = f"# Router overhead\n\n`{' '.join(argv)}`\n\n" + markdown_table(rows)
    if skipped:
        text += "\n" + "\n".join(f"- {line}" for line in skipped) + "\n"
    report.write_text(text)
    return report
