"""Faults during a replay (a scenario's ``degradation.actions``) and what they cost.

Each action fires at the scheduled offset of request ``at_request`` (the original's rule; in closed
loop, once that many requests have finished) against the live loopback fleet:

- ``delete_backend_pod``: SIGKILL the backend's engine and every Pylon in front of it, then start them
  again (new ports, empty cache), as the Deployment of the original would;
- ``scale_backend``: ``replicas: 0`` stops them (SIGTERM, a drain), more starts them again if stopped;
- ``kill_engine`` / ``kill_pylon``: SIGKILL the engine (its cluster's Pylons become faulty) or one Pylon;
- ``freeze_engine`` / ``freeze_pylon``: SIGSTOP, then SIGCONT after ``resume_after_ms`` (else at the end).

What a run with faults reports (``faults.json`` and a section of ``report.md``):

- requests sent, failed, and failed *without reaching an engine*: a request reached an engine when a
  mock engine's arrival log (``--arrival-log``, one unbuffered line per accepted request, so it
  survives SIGKILL) names it, or when the client saw a 200; the goal is that every failure did;
- per action, how long the faulty backends stayed routable: every Stargate's ``/debug/routing`` is
  sampled every 100 ms during the replay, and the time is from the action to the first sample of every
  Stargate that lists none of them (a backend entry with ``"routable": false`` counts as out). A
  backend that never left is reported as a lower bound: the time it was watched (until resumed or the
  end of the replay).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from stargate.bench.fleet import Fleet
from stargate.bench.peers.ground_truth import read_ground_truth
from stargate.bench.schema import DegradationAction, Scenario
from stargate.bench.score import RequestRecord
from stargate.bench.suite import markdown_table
from stargate.bench.workload import Workload

ARRIVAL_FILE = "arrivals.jsonl"
FAULTS_FILE = "faults.json"
SAMPLE_INTERVAL_S = 0.1
SAMPLE_TIMEOUT_S = 1.0
MAX_SAMPLES = 100_000
MAX_LISTED_IDS = 50

Sample = tuple[float, int, frozenset[str]]  # (seconds from replay start, Stargate index, routable ids)


@dataclass
class ActionReport:
    action: str
    backend_index: int
    backends: list[str]  # the backends this action made faulty
    at_s: float | None = None  # when it fired, seconds from replay start (None: never fired)
    resumed_s: float | None = None
    routable_s: float | None = None  # fired → out of routing on every Stargate, or the lower bound
    left_routing: bool = False
    error: str | None = None


@dataclass
class FaultReport:
    sent: int
    failed: int
    failed_before_engine: int
    failed_before_engine_ids: list[str] = field(default_factory=list)
    actions: list[ActionReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def arrival_args(scenario: Scenario, run_dir: Path) -> list[str]:
    """Mock engine flags for a run: the arrival log when the scenario injects faults."""
    return ["--arrival-log", str(run_dir / ARRIVAL_FILE)] if scenario.degradation.actions else []


def read_arrivals(path: Path) -> set[str]:
    """Request ids some engine accepted; a missing file is empty, a cut last line is skipped."""
    return set(read_ground_truth(path))  # same line format rules: JSON objects keyed by request_id


def routable_ids(payload: Any, model: str) -> frozenset[str]:
    """Backend ids ``/debug/routing`` lists for ``model`` under any routing key."""
    ids: set[str] = set()
    targets = payload.get("targets") if isinstance(payload, dict) else None
    for target in targets if isinstance(targets, list) else []:
        if not isinstance(target, dict) or target.get("model_id") != model:
            continue
        for cluster in target.get("clusters") or []:
            for backend in cluster.get("backends") or []:
                if backend.get("routable", True) is not False:
                    ids.add(str(backend.get("inference_server_id")))
    return frozenset(ids)


def routable_time(samples: Sequence[Sample], stargates: int, faulty: Sequence[str],
                  fired_s: float, until_s: float) -> tuple[float, bool]:
    """(seconds the faulty backends stayed routable after ``fired_s``, whether they left on every
    Stargate by ``until_s``); when they did not, the first value is the watched time, a lower bound."""
    left: dict[int, float] = {}
    for at, index, ids in samples:
        if fired_s <= at <= until_s and index not in left and not ids.intersection(faulty):
            left[index] = at
    if len(left) < stargates:
        return max(0.0, until_s - fired_s), False
    return max(left.values()) - fired_s, True


def failed_before_engine(records: Sequence[RequestRecord], arrived: set[str]) -> list[str]:
    """Ids of failed requests no engine accepted and that never got a 200."""
    return [r.request_id for r in records
            if not r.ok and r.status != 200 and r.request_id not in arrived]


class RoutingSampler:
    """Polls every Stargate's ``/debug/routing`` and keeps (time, Stargate, routable ids) samples."""

    def __init__(self, urls: Sequence[str], model: str, clock: Callable[[], float],
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.urls = list(urls)
        self.model = model
        self.clock = clock
        self.interval_s = interval_s
        self.samples: list[Sample] = []

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=SAMPLE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while len(self.samples) < MAX_SAMPLES:
                await asyncio.gather(*(self._sample(http, i, url) for i, url in enumerate(self.urls)))
                await asyncio.sleep(self.interval_s)

    async def _sample(self, http: aiohttp.ClientSession, index: int, url: str) -> None:
        try:
            async with http.get(url) as resp:
                payload = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return  # a Stargate that does not answer tells nothing about its routing table
        if payload is not None:
            self.samples.append((self.clock(), index, routable_ids(payload, self.model)))


class FaultInjector:
    """Fires the scenario's actions on a fleet during one replay; an async context manager.

    Entering starts the clock (align it with the replay: enter right before ``driver.replay``), the
    routing sampler and the action schedule; leaving stops them and resumes anything still frozen.
    """

    def __init__(self, scenario: Scenario, workload: Workload, fleet: Fleet,
                 finished: Callable[[], int] = lambda: 0) -> None:
        self.scenario = scenario
        self.workload = workload
        self.fleet = fleet
        self._finished = finished
        self._t0 = 0.0
        self.actions = [self._report_of(a) for a in scenario.degradation.actions]
        urls = [f"http://{sg.http}/debug/routing" for sg in fleet.stargates]
        self.sampler = RoutingSampler(urls, scenario.model, self.now)
        self._tasks: list[asyncio.Task[None]] = []
        self._frozen: list[tuple[ActionReport, Any]] = []
        self._restarting: set[asyncio.Task[None]] = set()
        self.end_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _report_of(self, action: DegradationAction) -> ActionReport:
        index = action.backend_index
        cluster = self.scenario.backends.cluster_of(index)
        members = [f"backend-{i}" for i in self.scenario.cluster_members()[cluster]]
        faulty = [f"backend-{index}"] if action.action in ("kill_pylon", "freeze_pylon") else members
        return ActionReport(action.action, index, faulty)

    async def __aenter__(self) -> FaultInjector:
        self._t0 = time.perf_counter()
        if self.actions:
            self._tasks.append(asyncio.create_task(self.sampler.run()))
            for action, report in zip(self.scenario.degradation.actions, self.actions, strict=True):
                self._tasks.append(asyncio.create_task(self._scheduled(action, report)))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.end_s = self.now()
        if self._restarting and exc_type is None:  # let a restart in progress finish (bounded)
            await asyncio.wait(self._restarting, timeout=2 * self.fleet.timeouts.start_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for report, proc in self._frozen:
            proc.signal(signal.SIGCONT)
            if report.resumed_s is None:
                report.resumed_s = self.end_s

    async def _scheduled(self, action: DegradationAction, report: ActionReport) -> None:
        planned = self.workload.requests[action.at_request] if action.at_request < len(
            self.workload.requests) else None
        if planned is not None and planned.at_ms is not None:
            await asyncio.sleep(max(0.0, planned.at_ms / 1000.0 - self.now()))
        else:
            while self._finished() < action.at_request:
                await asyncio.sleep(0.05)
        report.at_s = self.now()
        try:
            await self._fire(action, report)
        except Exception as exc:  # a failed action is reported, never fatal (spec §3.6)
            report.error = f"{type(exc).__name__}: {exc}"

    async def _fire(self, action: DegradationAction, report: ActionReport) -> None:
        fleet = self.fleet
        cluster = self.scenario.backends.cluster_of(action.backend_index)
        engine_id = "engine-" + str(min(self.scenario.cluster_members()[cluster]))
        kind = action.action
        if kind in ("kill_pylon", "freeze_pylon"):
            procs = [fleet.pylon_process(report.backends[0])]
        elif kind in ("kill_engine", "freeze_engine"):
            procs = [fleet.engine_process(engine_id)]
        else:
            procs = [fleet.engine_process(engine_id), *(fleet.pylon_process(b) for b in report.backends)]
        live = [p for p in procs if p is not None and p.returncode is None]
        if kind.startswith("freeze_"):
            for proc in live:
                proc.signal(signal.SIGSTOP)
                self._frozen.append((report, proc))
            if action.resume_after_ms is not None:
                await asyncio.sleep(action.resume_after_ms / 1000.0)
                for proc in live:
                    proc.signal(signal.SIGCONT)
                report.resumed_s = self.now()
            return
        if kind == "scale_backend" and action.replicas:
            if not live:
                await self._restart(cluster)
            return
        for proc in live:
            fleet.retire(proc)
            if kind == "scale_backend":
                await proc.stop(fleet.timeouts.stop_grace_s)
            else:
                proc.signal(signal.SIGKILL)
        if kind == "delete_backend_pod":
            await asyncio.gather(*(p.stop(fleet.timeouts.stop_grace_s) for p in live))
            await self._restart(cluster)

    async def _restart(self, cluster: str) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._restarting.add(task)
        await self.fleet.restart_cluster(cluster)

    def report(self, records: Sequence[RequestRecord], run_dir: Path) -> FaultReport:
        """The run's fault figures (also written as ``faults.json``)."""
        lost = failed_before_engine(records, read_arrivals(run_dir / ARRIVAL_FILE))
        stargates = len(self.sampler.urls)
        for report in self.actions:
            if report.at_s is None or report.error is not None or not stargates:
                continue  # no Stargate (a peer router's run): no routing table to watch
            until = report.resumed_s if report.resumed_s is not None else self.end_s
            report.routable_s, report.left_routing = routable_time(
                self.sampler.samples, stargates, report.backends, report.at_s, until)
        out = FaultReport(len(records), sum(not r.ok for r in records), len(lost),
                          lost[:MAX_LISTED_IDS], self.actions)
        (run_dir / FAULTS_FILE).write_bytes(orjson.dumps(out.to_dict(), option=orjson.OPT_INDENT_2))
        return out


def routable_cell(action: ActionReport) -> str:
    if action.error is not None:
        return f"error: {action.error}"
    if action.at_s is None:
        return "not fired"
    if action.routable_s is None:
        return "-"
    return f"{action.routable_s:.1f}" if action.left_routing else f">= {action.routable_s:.1f}"


def markdown_section(reports: Sequence[tuple[str, FaultReport]]) -> str:
    """The ``## Faults`` section of ``report.md``."""
    rows = [[run, action.action, f"backend-{action.backend_index}",
             "-" if action.at_s is None else f"{action.at_s:.1f}", str(fr.sent), str(fr.failed),
             str(fr.failed_before_engine), routable_cell(action)]
            for run, fr in reports for action in fr.actions]
    table = markdown_table(["Run", "Action", "Backend", "At s", "Sent", "Failed", "Failed before engine",
                            "Routable s"], rows)
    intro = ("Failed before an engine: failed requests that no mock engine accepted (its arrival log) and "
             "that never got a 200; the goal is 0. Routable s: from the fault to the first routing "
             "table of every Stargate without the faulty backends (`>=`: still listed when the watch "
             "ended).")
    return "\n".join(["", "## Faults", "", intro, "", *table]) + "\n"
