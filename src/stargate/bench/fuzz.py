"""``stargate-bench fuzz``: fuzzed requests against a real process fleet on loopback.

1 Stargate, ``--pylons`` Pylons and as many mock engines, started like every bench fleet. Each of
``--requests`` cases is one of: fuzzed contract headers, a fuzzed body, malformed HTTP/1.1 framing (to
Stargate's or a Pylon's port, raw sockets), or a fuzzed registration stream to Stargate's control
plane. Stargate runs in plain-client mode (``--plain-clients``: a request with the contract's
headers is forwarded as without it), and a share of the body cases sent to it carry only the
headers an OpenAI client sends, so its body parsing is fuzzed too. Every case draws from its own
seeded generator, so a run is repeatable whatever the concurrency. The summary gives requests per
category, the status histogram, undocumented 5xx, the tracebacks in the processes' logs, whether
every Pylon's registration stayed connected throughout (its ``pylon_registration_stream_connected``
sampled twice a second) and still routes (Stargate's ``/debug/routing``), and the status of a normal
request at the end. Goals: 0, 0, yes, 200; a missed goal makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from grpc import aio
from rich.console import Console
from rich.table import Table

from stargate.bench import fuzz_cases as fc
from stargate.bench import fuzz_registration as fr
from stargate.bench import plan
from stargate.bench.console import EXIT_FAILED, EXIT_OK, run_async
from stargate.bench.faults import routable_ids
from stargate.bench.fleet import Fleet, FleetTimeouts
from stargate.bench.peers.compare import recommended_run
from stargate.bench.schema import parse_scenario
from stargate.bench.suite import markdown_table
from stargate.flags import FlagSet, positive_int
from stargate.proto import stargate_pb2_grpc
from stargate.wire.limits import MAX_PLAUSIBLE_TPS

MODEL = "fuzz-model"
CATEGORIES = {"headers": 0.4, "bodies": 0.35, "framing": 0.15, "grpc": 0.1}
ANSWER_TIMEOUT_S = 10.0
INCOMPLETE_WAIT_S = 0.3
GRPC_TIMEOUT_S = 3.0
SAMPLE_INTERVAL_S = 0.5
MAX_EXAMPLES = 20
UNANSWERED = "no answer"
TRACEBACK = "Traceback (most recent call last)"
_CONNECTED = re.compile(r"^pylon_registration_stream_connected\{[^}]*\}\s+(\S+)", re.MULTILINE)
# No prefill model: the mock engine would hold a request claiming x-input-tokens: 2^32 for an hour,
# as it is meant to, and the run would measure that instead of the router.
PROFILE = {
    "max_concurrent_requests": 64,
    "service_time_ms": {"ttft_mean": 5, "decode_tokens_per_s": 1000},
    "registration": {"last_mean_input_tps": 100_000},
}


def add_parser(sub: Any, env: Mapping[str, str]) -> None:
    """Adds ``fuzz`` to the ``stargate-bench`` sub-commands."""
    help_text = "fuzzed headers, bodies, HTTP framing and gRPC registrations against a loopback fleet"
    a = FlagSet(sub.add_parser("fuzz", help=help_text), env).add
    a("--requests", type=positive_int, default=10_000, help="fuzz cases to send")
    a("--pylons", type=positive_int, default=3, help="Pylons (each with its own mock engine)")
    a("--concurrency", type=positive_int, default=16, help="cases in flight at once")
    a("--seed", type=int, default=0, help="generator seed (case i draws from seed and i)")
    a("--out", type=Path, default=Path(".bench-out/fuzz"), help="output directory (logs, summary)")
    a("--recommended", action="store_true",
      help="route with the recommended deployment (examples/lb-config/recommended.json and its flags) "
           "instead of power-of-n")  # fmt: skip


@dataclass
class FuzzReport:
    requests: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    undocumented_5xx: int = 0
    unanswered: int = 0  # complete requests neither answered nor closed within the answer timeout
    examples: list[str] = field(default_factory=list)  # the first undocumented answers
    tracebacks: dict[str, int] = field(default_factory=dict)  # log file → count
    registration_drops: int = 0  # samples in which some Pylon's stream was not connected
    routable_at_end: dict[str, bool] = field(default_factory=dict)
    metric_series: dict[str, int] = field(default_factory=dict)  # process → series at the end (bounded?)
    input_tps_at_end: dict[str, float] = field(default_factory=dict)  # cluster → last_mean_input_tps
    final_status: int | None = None

    def goals_met(self) -> bool:
        sane = all(0.0 <= tps <= MAX_PLAUSIBLE_TPS for tps in self.input_tps_at_end.values())  # NaN fails
        survived = sane and all(self.routable_at_end.values()) and self.final_status == 200
        return (
            survived
            and self.undocumented_5xx == self.unanswered == self.registration_drops == 0
            and (not self.tracebacks)
        )


def fuzz_scenario(pylons: int) -> Any:
    return parse_scenario({
        "name": "fuzz", "model": MODEL, "seed": 0, "request_count": 1, "max_concurrency": 1,
        "backends": {"count": pylons, "profile": PROFILE},
        "traffic_pattern": {"kind": "uniform", "input_tokens": {"distribution": "constant", "value": 8},
                            "output_tokens": {"distribution": "constant", "value": 2},
                            "arrival": {"distribution": "constant", "interval_ms": 10}},
        "algorithms": [{"name": "power-of-n", "config": {"default": "power-of-n"}}],
    }, file="fuzz")  # fmt: skip


def categories(count: int, seed: int) -> list[str]:
    """``count`` category names in the configured shares, shuffled by ``seed``."""
    names = [name for name, share in CATEGORIES.items() for _ in range(round(count * share))]
    names = (names + ["headers"] * count)[:count]
    random.Random(seed).shuffle(names)
    return names


class FuzzRun:
    def __init__(self, fleet: Fleet, seed: int, channel: aio.Channel) -> None:
        self.fleet = fleet
        self.seed = seed
        self.stub = stargate_pb2_grpc.StargateControlPlaneStub(channel)  # type: ignore[no-untyped-call]
        self.raw = fr.raw_register(channel)
        self.sg = fleet.stargates[0].http
        self.pylons = [p.http for p in fleet.pylons.values()]
        self.report = FuzzReport()
        self.framing = fc.framing_cases(MODEL)
        self._statuses: Counter[str] = Counter()

    def _record(self, category: str, outcome: str, detail: str) -> None:
        self._statuses[outcome] += 1
        undocumented = outcome.isdigit() and fc.undocumented_5xx(int(outcome))
        self.report.undocumented_5xx += undocumented
        self.report.unanswered += outcome == UNANSWERED
        if (undocumented or outcome == UNANSWERED) and len(self.report.examples) < MAX_EXAMPLES:
            self.report.examples.append(f"{category} {outcome}: {detail[:300]}")

    async def case(self, index: int, category: str) -> None:
        rng = random.Random(f"{self.seed}-{index}")
        if category == "grpc":
            url = f"http://{rng.choice(self.pylons)}"
            last = await fr.fuzz_stream(self.stub, self.raw, rng, url, index, MODEL, GRPC_TIMEOUT_S)
            self._record(category, f"grpc {last}", "")
            return
        addr = self.sg if rng.random() < 0.5 else rng.choice(self.pylons)
        complete = True
        if category == "framing":
            framing = rng.choice(self.framing)
            data, detail, complete = framing.data, framing.name, framing.complete
        else:
            request_id = f"fuzz-{index}"
            if category == "bodies":
                (body, extra), headers = fc.fuzz_body(rng, MODEL), fc.valid_headers(MODEL, request_id)
                if addr == self.sg and rng.random() < 0.3:
                    headers = fc.plain_headers(request_id)  # the body is read for the model and prompt
            else:
                (body, extra), headers = (fc.valid_body(MODEL), {}), fc.fuzz_headers(rng, MODEL, request_id)
            data, detail = fc.request_bytes(rng.choice(fc.PATHS), headers | extra, body), repr(headers)
        try:
            answer = await fc.exchange(addr, data, ANSWER_TIMEOUT_S if complete else INCOMPLETE_WAIT_S)
        except OSError as exc:
            self._record(category, f"connect failed ({type(exc).__name__})", detail)
            return
        outcome = "closed" if answer.closed else "incomplete request, client gave up"
        if answer.status is not None:
            outcome = str(answer.status)
        elif complete and not answer.closed:
            outcome = UNANSWERED
        self._record(category, outcome, f"{addr} {detail}")

    async def run(self, count: int, concurrency: int) -> None:
        plan_ = categories(count, self.seed)
        self.report.requests = dict(Counter(plan_))
        queue = iter(enumerate(plan_))

        async def worker() -> None:
            for index, category in queue:
                await self.case(index, category)

        sampler = asyncio.create_task(self._sample_registrations())
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        self.report.statuses = dict(sorted(self._statuses.items()))

    async def _sample_registrations(self) -> None:
        metrics = [p.metrics for p in self.fleet.pylons.values() if p.metrics]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while True:
                for addr in metrics:
                    if not await _connected(http, addr):
                        self.report.registration_drops += 1
                await asyncio.sleep(SAMPLE_INTERVAL_S)

    async def finish(self) -> None:
        """Every Pylon still routable on Stargate, and a normal request answered."""
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http,
            http.get(f"http://{self.sg}/debug/routing") as resp,
        ):
            routing = orjson.loads(await resp.read())
            ids = routable_ids(routing, MODEL)
            self.report.input_tps_at_end = input_tps(routing, MODEL)
            self.report.routable_at_end = {backend: backend in ids for backend in self.fleet.pylons}
            targets = [("stargate-0", self.fleet.stargates[0].metrics)]
            targets += [(f"pylon-{b}", p.metrics) for b, p in self.fleet.pylons.items()]
            for name, addr in targets:
                if addr is not None:
                    async with http.get(f"http://{addr}/metrics") as metrics:
                        text = await metrics.text()
                    series = [line for line in text.splitlines() if line and not line.startswith("#")]
                    self.report.metric_series[name] = len(series)
        data = fc.request_bytes(fc.PATHS[0], fc.valid_headers(MODEL, "final"), fc.valid_body(MODEL))
        self.report.final_status = (await fc.exchange(self.sg, data, ANSWER_TIMEOUT_S)).status


def input_tps(routing: Any, model: str) -> dict[str, float]:
    """``last_mean_input_tps`` per cluster of ``model`` in ``/debug/routing`` (NaN when unreadable):
    absurd claimed token counts must not have poisoned it."""
    found: dict[str, float] = {}
    for target in routing.get("targets") or [] if isinstance(routing, dict) else []:
        if isinstance(target, dict) and target.get("model_id") == model:
            for cluster in target.get("clusters") or []:
                tps = (cluster.get("stats") or {}).get("last_mean_input_tps")
                value = float(tps) if isinstance(tps, int | float) else math.nan
                found[str(cluster.get("cluster_id"))] = value
    return found


async def _connected(http: aiohttp.ClientSession, addr: str) -> bool:
    try:
        async with http.get(f"http://{addr}/metrics") as resp:
            values = _CONNECTED.findall(await resp.text())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
    return bool(values) and all(float(v) == 1.0 for v in values)


def count_tracebacks(log_dir: Path) -> dict[str, int]:
    logs = sorted(log_dir.glob("*.log"))
    counts = {path.name: path.read_text(errors="replace").count(TRACEBACK) for path in logs}
    return {name: n for name, n in counts.items() if n}


async def run_fuzz(
    requests: int, pylons: int, concurrency: int, seed: int, out: Path, recommended: bool = False
) -> FuzzReport:
    scenario = fuzz_scenario(pylons)
    spec = recommended_run(scenario) if recommended else plan.runs(scenario)[0]
    spec = dataclasses.replace(spec, stargate_args=(*spec.stargate_args, *plan.PLAIN_STARGATE_ARGS))
    fleet = Fleet(scenario, spec, out, FleetTimeouts(start_s=30.0, ready_s=60.0))
    async with fleet, aio.insecure_channel(fleet.stargates[0].grpc) as channel:
        run = FuzzRun(fleet, seed, channel)
        await run.run(requests, concurrency)
        await run.finish()
        fleet.check_alive()
    run.report.tracebacks = count_tracebacks(fleet.log_dir)
    return run.report


def summary_markdown(report: FuzzReport) -> str:
    lines = ["| Category | Requests |", "| --- | --- |"]
    lines += [f"| {name} | {n} |" for name, n in report.requests.items()]
    lines += ["", *markdown_table(["Answer", "Count"], [[k, str(v)] for k, v in report.statuses.items()]), ""]
    lines += [f"- undocumented 5xx: {report.undocumented_5xx}",
              f"- complete requests not answered or closed in {ANSWER_TIMEOUT_S:g} s: {report.unanswered}",
              f"- tracebacks in process logs: {sum(report.tracebacks.values())} {report.tracebacks or ''}",
              f"- registration samples not connected: {report.registration_drops}",
              f"- routable at the end: {report.routable_at_end}",
              f"- metric series at the end: {report.metric_series}",
              f"- input TPS per cluster at the end (<= {MAX_PLAUSIBLE_TPS:g}): {report.input_tps_at_end}",
              f"- normal request at the end: {report.final_status}",
              f"- goals met: {'yes' if report.goals_met() else 'no'}"]  # fmt: skip
    lines += [f"- {example}" for example in report.examples]
    return "\n".join(lines) + "\n"


def fuzz_command(console: Console, args: argparse.Namespace) -> int:
    with console.status(f"fuzzing a loopback fleet with {args.requests} cases"):
        report = run_async(
            run_fuzz(args.requests, args.pylons, args.concurrency, args.seed, args.out, args.recommended)
        )
    table = Table("Answer", "Count", title=f"fuzz ({args.requests} cases: {report.requests})")
    for answer, count in report.statuses.items():
        table.add_row(answer, str(count))
    console.print(table)
    text = summary_markdown(report)
    console.print(text.split("\n\n")[-1], highlight=False)
    (args.out / "fuzz.md").write_text(text, encoding="utf-8")
    (args.out / "fuzz.json").write_bytes(orjson.dumps(asdict(report), option=orjson.OPT_INDENT_2))
    console.print(f"summary: {args.out / 'fuzz.md'}; logs: {args.out / 'logs'}", highlight=False)
    return EXIT_OK if report.goals_met() else EXIT_FAILED
