"""``stargate-bench compare``: Stargate algorithms and other routers on identical fresh fleets.

Every (router, repeat) gets a fresh set of mock engines (empty caches, new ports); a Stargate run also
gets its Stargates and Pylons, a peer run its router process pointed straight at the engines. The
workload is built once, so every router sees the same requests, prompt texts and mock seeds; each
router gets the request headers it can use (``adapters``). Repeats are interleaved by default.
Cache hits and the serving engine come from the mock engines' ground-truth request log, joined on
request id (``ground_truth``), so attribution never depends on what a router passes back.

Peer routers drop the bench's request headers (sglang-router forwards only ``x-request-id``), so a
header-keyed mock cache would see no key behind them: when a peer is compared and the scenario uses
``mock.kv_mode: affinity``, every run of the comparison switches to ``prefix`` (content blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from stargate.balancer.config import parse_algorithm_name
from stargate.bench import plan
from stargate.bench.driver import Driver, make_session
from stargate.bench.faults import arrival_args
from stargate.bench.fleet import Fleet, FleetTimeouts
from stargate.bench.peers.adapters import (
    PACKAGES,
    DirectAdapter,
    Kind,
    PeerRouterAdapter,
    RouterAdapter,
    StargateAdapter,
    is_plain_label,
    parse_router_label,
)
from stargate.bench.peers.ground_truth import GROUND_TRUTH_FILE, apply_ground_truth, read_ground_truth
from stargate.bench.peers.install import ensure_installed, peers_root
from stargate.bench.peers.tokenizer import write_tokenizer_dir
from stargate.bench.plan import RunSpec
from stargate.bench.report import write_report
from stargate.bench.runner import (
    Order,
    PlannedRun,
    Progress,
    RunOutcome,
    SilentProgress,
    SuiteResult,
    append_fault_section,
    plan_runs,
    replay_with_faults,
    summarize_outcome,
    write_records,
    write_run_metadata,
    write_runs,
)
from stargate.bench.schema import Scenario
from stargate.bench.workload import PlannedRequest, Workload
from stargate.errors import ConfigError, PeerInstallError
from stargate.mock_engine.peer_compat import TOKENIZER_ENV

AdapterFactory = Callable[[], RouterAdapter]


@dataclass(frozen=True)
class PeerOptions:
    install: bool = True
    nodelay: bool = False
    root: Path | None = None

    def tokenizer_dir(self, model: str) -> Path:
        directory = (self.root or peers_root()) / "tokenizers" / model.replace("/", "_")
        return write_tokenizer_dir(directory, model)


@dataclass(frozen=True)
class RouterChoice:
    label: str
    kind: Kind
    spec: RunSpec  # the Stargate run (lb config, pylon args); a named placeholder for other routers
    make: AdapterFactory


RECOMMENDED = "recommended"
RECOMMENDED_STARGATE_ARGS = ("--default-max-wait-ms", "60000")
"""The recommended deployment's router flag (docs/configuration.md): requests without x-max-wait-ms
wait for a free slot instead of getting the spec's immediate 503."""
RECOMMENDED_PYLON_ARGS = ("--stats-update-coalesce-ms", "10")
"""The recommended deployment's Pylon flag (docs/pylon.md): load changes are published within 10 ms,
so every replica sees what the others have in flight, not only what the last heartbeat counted."""
PREFIX_CACHING_PYLON_ARGS = ("--engine-prefix-caching", "true")
"""Added where the scenario's engines keep a KV cache, as docs/pylon.md recommends for engines with
prefix caching: a conversation's published prompt work is what its engine's cache does not hold."""
RECOMMENDED_FILE = Path(__file__).resolve().parents[4] / "examples" / "lb-config" / "recommended.json"
SHARED_PREFILL_SETTINGS: dict[str, object] = {
    "cache_affinity_await_prefill": True,
    "cache_affinity_yield_margin_ms": 1000,
}
"""Added where the scenario's engines start every admitted prefill at once (the mock's
``continuous`` and ``independent`` batching), as docs/configuration.md recommends for such engines:
a turn sent beside its predecessor's prefill would prefill the shared prefix again, and a loaded
engine slows every prompt it shares itself between. Not under ``vllm``, whose first-come-first-served
queue already puts the turn behind its predecessor, whose cache it then reuses."""


PREFILL_SHARING_SETTINGS: dict[str, object] = {"prefill_sharing": True}
"""Added where the scenario's engines share their prefill rate between the prompts they prefill at
once (the mock's ``continuous`` batching), as docs/configuration.md recommends: a prompt sent there
shares the rate with those prefilling instead of waiting for them, and slows each of them. Not under
``independent`` (every prompt at the full rate) nor ``vllm`` (a prompt queues behind the others)."""


def recommended_lb_config(model: str, path: Path = RECOMMENDED_FILE) -> dict[str, object]:
    """``examples/lb-config/recommended.json`` with its one model entry renamed to ``model``: what
    ``stargate:recommended`` runs (with ``RECOMMENDED_STARGATE_ARGS``) unless the scenario has its own
    ``recommended`` entry. Several Stargate replicas run it unchanged: Pylon publishes where keys
    went, so replicas placing keys by load follow each other (docs/configuration.md)."""
    try:
        config = orjson.loads(path.read_bytes())
        (settings,) = config["models"].values()
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot use {path} as the recommended config: {exc}", path="--routers") from exc
    return {**config, "models": {model: settings}}


def _with_settings(
    lb_config: dict[str, object], settings: dict[str, object], needs: str
) -> dict[str, object]:
    """``settings`` on every wait-and-widen model entry that sets ``needs``."""
    models = lb_config.get("models")
    if not isinstance(models, dict):
        return lb_config
    changed = {
        name: {**entry, **settings}
        if isinstance(entry, dict) and entry.get("algorithm") == "wait-and-widen" and entry.get(needs)
        else entry
        for name, entry in models.items()
    }
    return {**lb_config, "models": changed}


def _has_kv_cache(scenario: Scenario) -> bool:
    backends = scenario.backends
    return all(backends.profile_of(index).kv_cache_capacity_tokens > 0 for index in range(backends.count))


def recommended_run(scenario: Scenario, spec: RunSpec | None = None, *, streaming: bool = True) -> RunSpec:
    """The recommended deployment on ``scenario``'s fleet: ``spec`` (the scenario's own
    ``recommended`` entry, the demo's) or the file, with the router and Pylon flags the docs
    recommend and the settings its engines call for. ``streaming`` says the clients stream, as the
    bench's do: ``SHARED_PREFILL_SETTINGS`` are for them only (a non-streamed answer's first byte
    is its last, and a request held for it would wait for the whole answer)."""
    spec = spec or RunSpec(RECOMMENDED, recommended_lb_config(scenario.model), [])
    pylon_args = [*spec.pylon_args, *RECOMMENDED_PYLON_ARGS]
    lb_config = spec.lb_config
    if _has_kv_cache(scenario):
        pylon_args += PREFIX_CACHING_PYLON_ARGS
        if streaming and scenario.mock.batching != "vllm":
            affinity = "cache_affinity_backend_selection_count"
            lb_config = _with_settings(lb_config, SHARED_PREFILL_SETTINGS, affinity)
    if scenario.mock.batching == "continuous":
        lb_config = _with_settings(lb_config, PREFILL_SHARING_SETTINGS, "load_aware")
    return dataclasses.replace(spec, lb_config=lb_config, stargate_args=RECOMMENDED_STARGATE_ARGS,
                               pylon_args=pylon_args)


def resolve_routers(scenario: Scenario, text: str, options: PeerOptions) -> list[RouterChoice]:
    """Parse ``--routers``; ``stargate:<name>`` is an ``algorithms[]`` entry, else a bare algorithm."""
    labels = [part.strip() for part in text.split(",") if part.strip()]
    if not labels:
        raise ConfigError("no routers given", path="--routers")
    if len(set(labels)) != len(labels):
        raise ConfigError("a router is listed twice", path="--routers")
    entries = {spec.name: spec for spec in plan.runs(scenario)}
    choices: list[RouterChoice] = []
    for label in labels:
        kind, name = parse_router_label(label)
        if kind == "stargate":
            spec = entries.get(name)
            if name == RECOMMENDED:
                spec = recommended_run(scenario, spec, streaming=scenario.client.stream)
            if spec is None:
                algorithm = parse_algorithm_name(name, "--routers").value
                spec = RunSpec(name, {"default": algorithm}, [])
            spec = RunSpec(label, spec.lb_config, spec.pylon_args, spec.stargate_args)
            plain = is_plain_label(label)
            if plain:
                spec = plan.with_plain_clients(spec)
            choices.append(RouterChoice(label, kind, spec,
                                        functools.partial(StargateAdapter, label, plain=plain)))
        elif kind == "direct":
            choices.append(RouterChoice(label, kind, RunSpec(label, {}, []), DirectAdapter))
        else:
            tok = options.tokenizer_dir(scenario.model)

            make = functools.partial(PeerRouterAdapter, kind, name, tok, peers_root=options.root,
                                     install=options.install, nodelay=options.nodelay)
            choices.append(RouterChoice(label, kind, RunSpec(label, {}, []), make))
    return choices


def comparable_scenario(scenario: Scenario, choices: Sequence[RouterChoice]) -> Scenario:
    """The scenario with a content-keyed mock cache when a router that reads prompt text, not the
    workload's headers, is compared."""
    if scenario.mock.kv_mode != "affinity" or all(
        c.kind == "direct" or (c.kind == "stargate" and not is_plain_label(c.label)) for c in choices
    ):
        return scenario
    base = scenario.base_dir
    copy = scenario.model_copy(update={"mock": scenario.mock.model_copy(update={"kv_mode": "prefix"})})
    copy._base_dir = base
    return copy


def adapt_workload(workload: Workload, adapter: RouterAdapter) -> Workload:
    """The same requests with the headers ``adapter`` can use."""
    requests = tuple(dataclasses.replace(r, headers=adapter.request_headers(r)) for r in workload.requests)
    by_id: dict[str, PlannedRequest] = {r.request_id: r for r in requests}
    sessions = tuple(tuple(by_id.get(t.request_id, t) for t in s) for s in workload.sessions)
    return dataclasses.replace(workload, requests=requests, sessions=sessions)


def body_limits(choices: Sequence[RouterChoice]) -> bool:
    """Some run's engine sees no ``x-output-tokens``: a plain client's, or a peer router's."""
    return any(c.kind in ("sglang", "vllm") or is_plain_label(c.label) for c in choices)


def engine_args(workload: Workload, by_body: bool) -> list[str]:
    """With ``by_body`` (``body_limits``), the engines' default output length covers the longest
    request.

    A run whose client sends no ``x-output-tokens`` (a ``stargate-plain`` run, as a plain client)
    or whose router drops it (sglang-router, which also renames ``max_tokens`` to
    ``max_completion_tokens``) leaves the engine its default length, which a body's limit may only
    shorten; raising the default to the workload's longest output keeps every run's responses the
    lengths the workload asked for. Every run of a comparison uses the same engine arguments.
    """
    if not by_body or not workload.requests:
        return []
    return ["--num-tokens", str(max(r.output_tokens for r in workload.requests))]


async def execute_choice(scenario: Scenario, workload: Workload, planned: PlannedRun, choice: RouterChoice,
                         progress: Progress, timeouts: FleetTimeouts | None,
                         tokenizer_dir: Path | None, by_body: bool) -> RunOutcome:
    """One run of one router; failures become ``outcome.error`` (cancellation propagates after teardown)."""
    outcome = RunOutcome(planned, pylons_in_path=choice.kind == "stargate")
    progress.run_started(planned.name, len(workload.requests))
    planned.run_dir.mkdir(parents=True, exist_ok=True)
    adapter = choice.make()
    (planned.run_dir / "run-info.json").write_bytes(orjson.dumps(
        {"name": planned.name, "router": choice.label, "kind": choice.kind, "signal": adapter.signal,
         "repeat": planned.repeat, "lb_config": planned.spec.lb_config, "pylon_args": planned.spec.pylon_args,
         "stargate_args": list(planned.spec.stargate_args),
         "kv_mode": scenario.mock.kv_mode}, option=orjson.OPT_INDENT_2))
    env = {TOKENIZER_ENV: str(tokenizer_dir)} if tokenizer_dir is not None else None
    truth_path = planned.run_dir / GROUND_TRUTH_FILE
    driver: Driver | None = None
    try:
        async with Fleet(scenario, planned.spec, planned.run_dir, timeouts,
                         with_stargate=choice.kind == "stargate", engine_env=env,
                         engine_args=[*engine_args(workload, by_body),
                                      "--request-log", str(truth_path),
                                      *arrival_args(scenario, planned.run_dir)]) as fleet:
            try:
                await adapter.attach(fleet, fleet.log_dir)
                if choice.kind == "stargate":
                    await fleet.scrape("before")
                (planned.run_dir / "fleet.json").write_bytes(orjson.dumps(
                    {"stargates": fleet.stargates, "pylons": fleet.pylons, "engines": fleet.engines,
                     "router_urls": adapter.urls}, option=orjson.OPT_INDENT_2))
                adapted = adapt_workload(workload, adapter)
                async with make_session(workload.max_concurrency) as session:
                    driver = Driver(session, adapter.urls, planned.name,
                                    on_record=lambda r: progress.request_done(planned.name, r))
                    outcome.records, outcome.duration_s, outcome.faults = await replay_with_faults(
                        scenario, adapted, fleet, driver, planned.run_dir)
                if choice.kind == "stargate":
                    await fleet.scrape("after")
            finally:
                await adapter.stop()
        truth = await asyncio.to_thread(read_ground_truth, truth_path)  # engines flushed on exit
        outcome.records = apply_ground_truth(outcome.records, truth)
    except Exception as exc:  # one failed run must not end the suite
        outcome.error = f"{type(exc).__name__}: {exc}"
        (planned.run_dir / "error.txt").write_text(outcome.error + "\n")
    finally:
        if not outcome.records and driver is not None:  # interrupted: keep what finished
            outcome.records = sorted(driver.records, key=lambda r: r.index)
        write_records(planned.run_dir / "requests.jsonl", outcome.records)
        progress.run_finished(planned.name, outcome.error)
    return outcome


async def run_compare(scenario: Scenario, workload: Workload, out_dir: Path,
                      choices: Sequence[RouterChoice], *,
                      repeats: int = 1, order: Order = "interleaved", seed: int = 0,
                      progress: Progress | None = None, timeouts: FleetTimeouts | None = None,
                      slo_ttft_ms: float | None = None, argv: Sequence[str] = (),
                      options: PeerOptions | None = None) -> SuiteResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_metadata(out_dir / "run-metadata.json", argv)
    opts = options or PeerOptions()
    tokenizer_dir = None
    peers = sorted({c.kind for c in choices if c.kind in ("sglang", "vllm")})
    if peers:
        tokenizer_dir = await asyncio.to_thread(opts.tokenizer_dir, scenario.model)
    if opts.install:
        for kind in peers:  # install before the first run; a failure resurfaces as that router's run error
            with contextlib.suppress(PeerInstallError):
                await asyncio.to_thread(ensure_installed, PACKAGES[kind], opts.root)
    watcher = progress or SilentProgress()
    by_body = body_limits(choices)
    by_label = {c.label: c for c in choices}
    outcomes: list[RunOutcome] = []
    for planned in plan_runs([c.spec for c in choices], out_dir, repeats, order, seed):
        choice = by_label[planned.spec.name]
        outcomes.append(await execute_choice(scenario, workload, planned, choice, watcher, timeouts,
                                             tokenizer_dir, by_body))
    write_runs(out_dir / "runs.json", outcomes)
    summaries = [summarize_outcome(o, scenario, slo_ttft_ms) for o in outcomes]
    records_by_run = {o.planned.name: o.records for o in outcomes}
    report = await asyncio.to_thread(write_report, out_dir, scenario, summaries, records_by_run)
    append_fault_section(report, outcomes)
    signals = [{"router": c.label, "signal": c.make().signal} for c in choices]
    (out_dir / "routers.json").write_bytes(orjson.dumps(
        {"kv_mode": scenario.mock.kv_mode, "routers": signals}, option=orjson.OPT_INDENT_2))
    with report.open("a") as sink:
        sink.write("\n## Routers and the signal each was given\n\n| router | signal |\n|---|---|\n")
        sink.writelines(f"| {s['router']} | {s['signal']} |\n" for s in signals)
        sink.write(f"\nMock KV cache mode for every run: `{scenario.mock.kv_mode}`.\n")
    return SuiteResult(out_dir, tuple(outcomes), tuple(summaries), report)
