"""A fresh loopback fleet for one bench run: mock engines, Stargates and one Pylon per backend.

Every process binds port 0 and announces its addresses on a ready line; the one-line parsers below
are the only place that knows those formats. ``Fleet`` is an async context manager: leaving it, for
any reason (failure, Ctrl-C, cancellation), stops every child it started. Fault injection reaches the
processes through ``engine_process``/``pylon_process`` (signals), ``retire`` (a child that is meant to
be dead no longer fails ``check_alive``) and ``restart_cluster`` (an engine and its Pylons anew).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import orjson

from stargate.bench import plan
from stargate.bench.plan import BackendSpec, EngineSpec, RunSpec
from stargate.bench.procs import ManagedProcess, stop_all
from stargate.bench.schema import Scenario
from stargate.errors import ProcessError
from stargate.wire import headers as h

PROBE_REQUEST_PREFIX = "__stargate_bench_ready-probe"
PROBE_CACHE_KEY_PREFIX = "__stargate_bench_benchmark-ready-probe"

_ENGINE_READY = re.compile(r"listening on (https?://\S+)")


def _ready_fields(line: str, marker: str) -> dict[str, str] | None:
    """``key=value`` words after ``marker`` (e.g. ``pylon ready http=127.0.0.1:5 metrics=6``)."""
    at = line.find(marker)
    if at < 0:
        return None
    pairs = (word.partition("=") for word in line[at + len(marker):].split())
    return {key: _addr(value) for key, sep, value in pairs if sep and value}


def _addr(value: str) -> str:
    """``host:port`` from ``host:port``, ``http://host:port[/]`` or a bare port (bound on loopback)."""
    value = value.removeprefix("http://").rstrip("/")
    return f"127.0.0.1:{value}" if value.isdigit() else value


@dataclass(frozen=True)
class StargateAddrs:
    grpc: str
    http: str
    metrics: str | None


@dataclass(frozen=True)
class PylonAddrs:
    http: str
    metrics: str | None


def parse_stargate_ready(line: str) -> StargateAddrs | None:
    fields = _ready_fields(line, "stargate ready")
    if not fields or "grpc" not in fields or "http" not in fields:
        return None
    return StargateAddrs(fields["grpc"], fields["http"], fields.get("metrics"))


def parse_pylon_ready(line: str) -> PylonAddrs | None:
    fields = _ready_fields(line, "pylon ready")
    if not fields or "http" not in fields:
        return None
    return PylonAddrs(fields["http"], fields.get("metrics"))


def parse_engine_ready(line: str) -> str | None:
    """The engine's base URL (``http://host:port``)."""
    m = _ENGINE_READY.search(line)
    return m.group(1).rstrip("/") if m else None


def command(script: str) -> list[str]:
    """argv prefix that runs a console script of this installation with this interpreter."""
    beside = Path(sys.executable).parent / script
    if beside.is_file():
        return [str(beside)]
    for ep in importlib.metadata.entry_points(group="console_scripts", name=script):
        module, _, attr = ep.value.partition(":")
        return [sys.executable, "-c", f"import sys; from {module} import {attr}; sys.exit({attr}())"]
    raise ProcessError(f"console script {script!r} is not installed (pip install -e . in this environment)")


@dataclass(frozen=True)
class FleetTimeouts:
    start_s: float = 30.0
    ready_s: float = 60.0
    stop_grace_s: float = 5.0
    poll_s: float = 0.2


class Fleet:
    """Processes of one run; ``stargate_urls`` are the chat-completions URLs once ``start`` returned."""

    def __init__(self, scenario: Scenario, run: RunSpec, run_dir: Path,
                 timeouts: FleetTimeouts | None = None, *, with_stargate: bool = True,
                 engine_env: dict[str, str] | None = None, engine_args: Sequence[str] = ()) -> None:
        """``with_stargate=False`` starts the mock engines only (for routers that front them directly);
        ``engine_env`` is added to the engines' environment, ``engine_args`` to their command lines.
        Every Stargate and Pylon flag of the run is in ``run`` (``RunSpec.stargate_args``/``pylon_args``)."""
        self.scenario = scenario
        self.with_stargate = with_stargate
        self.engine_env = engine_env
        self.engine_args = list(engine_args)
        self.run = run
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.timeouts = timeouts or FleetTimeouts()
        self.stargates: list[StargateAddrs] = []
        self.pylons: dict[str, PylonAddrs] = {}
        self.engines: dict[str, str] = {}
        self._procs: list[ManagedProcess[Any]] = []
        self._by_role: dict[str, ManagedProcess[Any]] = {}  # "engine-0" / "backend-0" → current process
        self._retired: list[ManagedProcess[Any]] = []
        self._generation = itertools.count(1)

    async def __aenter__(self) -> Fleet:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    @property
    def stargate_urls(self) -> list[str]:
        return [f"http://{sg.http}/v1/chat/completions" for sg in self.stargates]

    async def _launch(self, procs: Sequence[ManagedProcess[Any]]) -> list[Any]:
        for proc in procs:
            self._procs.append(proc)
            await proc.start()
        return list(await asyncio.gather(*(p.wait_ready(self.timeouts.start_s) for p in procs)))

    async def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        engines = plan.engines(self.scenario)
        urls = await self._launch([self._engine_proc(e) for e in engines])
        self.engines = {e.engine_id: url for e, url in zip(engines, urls, strict=True)}
        self._by_role.update({e.engine_id: p for e, p in zip(engines, self._procs, strict=True)})
        if not self.with_stargate:
            return

        lb_path = self.run_dir / "lb-config.json"
        lb_path.write_bytes(orjson.dumps(self.run.lb_config, option=orjson.OPT_INDENT_2))
        # Pylons seed their discovery at sg-0, which announces the others as remote watch URLs;
        # so the others start first and sg-0 is given their bound gRPC addresses.
        count = max(1, self.scenario.stargates.count)
        other_procs = [self._stargate_proc(i, lb_path, []) for i in range(1, count)]
        others = await self._launch(other_procs)
        seeds = [f"http://{sg.grpc}" for sg in others]
        first_proc = self._stargate_proc(0, lb_path, seeds)
        first = await self._launch([first_proc])
        self.stargates = [*first, *others]
        self._by_role.update({f"sg-{i}": p for i, p in enumerate([first_proc, *other_procs])})

        backends = plan.backend_specs(self.scenario)
        await self._start_pylons(backends)
        await self.wait_routable()

    async def _start_pylons(self, backends: Sequence[BackendSpec], suffix: str = "") -> None:
        procs = [self._pylon_proc(b, suffix) for b in backends]
        addrs = await self._launch(procs)
        self.pylons.update({b.backend_id: a for b, a in zip(backends, addrs, strict=True)})
        self._by_role.update({b.backend_id: p for b, p in zip(backends, procs, strict=True)})

    def engine_process(self, engine_id: str) -> ManagedProcess[Any] | None:
        return self._by_role.get(engine_id)

    def pylon_process(self, backend_id: str) -> ManagedProcess[Any] | None:
        return self._by_role.get(backend_id)

    def stargate_process(self, index: int) -> ManagedProcess[Any] | None:
        return self._by_role.get(f"sg-{index}")

    def retire(self, proc: ManagedProcess[Any]) -> None:
        """``proc`` is meant to exit (killed or stopped on purpose); teardown still reaps it."""
        self._retired.append(proc)

    async def restart_cluster(self, cluster_id: str) -> None:
        """Start the cluster's engine and Pylons again (empty cache), as a Deployment would.

        The engine gets its old address back (a Service's address survives its pod, and routers that
        front the engines directly keep theirs); Pylons get new ports and register anew. The processes
        they replace must be stopped and retired first; new log files get a suffix.
        """
        suffix = f".restart{next(self._generation)}"
        backends = [b for b in plan.backend_specs(self.scenario) if b.cluster_id == cluster_id]
        engine_ids = {b.engine_id for b in backends}
        engines = [e for e in plan.engines(self.scenario) if e.engine_id in engine_ids]
        procs = [self._engine_proc(e, suffix, self.engines[e.engine_id].removeprefix("http://"))
                 for e in engines]
        urls = await self._launch(procs)
        self.engines.update({e.engine_id: url for e, url in zip(engines, urls, strict=True)})
        self._by_role.update({e.engine_id: p for e, p in zip(engines, procs, strict=True)})
        if self.with_stargate:
            await self._start_pylons(backends, suffix)

    def _engine_proc(self, spec: EngineSpec, suffix: str = "",
                     addr: str = "127.0.0.1:0") -> ManagedProcess[str]:
        argv = [*command("stargate-mock-engine"), *spec.args, *self.engine_args, "--http-listen-addr", addr]
        env = {**os.environ, **self.engine_env} if self.engine_env else None
        return ManagedProcess(f"engine-{spec.engine_id}{suffix}", argv, self.log_dir, parse_engine_ready,
                              env=env)

    def _stargate_proc(self, index: int, lb_path: Path, seeds: list[str]) -> ManagedProcess[StargateAddrs]:
        argv = [
            *command("stargate"),
            "--stargate-id", f"sg-{index}",
            "--listen-addr", "127.0.0.1:0",
            "--advertise-addr", "127.0.0.1:0",
            "--model-discovery-listen-addr", "127.0.0.1:0",
            "--http-listen-addr", "127.0.0.1:0",
            "--metrics-host", "127.0.0.1",
            "--metrics-port", "0",
            "--disable-dns-discovery",
            "--lb-config-path", str(lb_path),
        ]
        for seed in seeds:
            argv += ["--remote-stargate-url", seed]
        argv += self.run.stargate_args
        return ManagedProcess(f"stargate-{index}", argv, self.log_dir, parse_stargate_ready)

    def _pylon_proc(self, spec: BackendSpec, suffix: str = "") -> ManagedProcess[PylonAddrs]:
        argv = [
            *command("pylon"),
            *spec.pylon_args,
            *self.run.pylon_args,
            "--upstream-http-base-url", self.engines[spec.engine_id],
            "--http-listen-addr", "127.0.0.1:0",
            "--metrics-host", "127.0.0.1",
            "--metrics-port", "0",
            "--stargate-address", self.stargates[0].grpc,
        ]
        if "--inference-server-id" not in argv:
            argv += ["--inference-server-id", spec.backend_id]
        if "--cluster-id" not in argv:
            argv += ["--cluster-id", spec.cluster_id]
        return ManagedProcess(f"pylon-{spec.backend_id}{suffix}", argv, self.log_dir, parse_pylon_ready)

    def pids(self) -> dict[str, int]:
        """Live child pids by process name (``engine-…``, ``stargate-…``, ``pylon-…``)."""
        return {p.name: p.pid for p in self._procs if p.pid is not None and p.returncode is None}

    def check_alive(self) -> None:
        for proc in self._procs:
            if proc.returncode is not None and proc not in self._retired:
                raise ProcessError(f"{proc.name} exited with code {proc.returncode}\n{proc.log_tail()}")

    async def wait_routable(self) -> None:
        """Every Stargate lists the model, counts every backend active, and serves a probe request."""
        deadline = time.monotonic() + self.timeouts.ready_s
        expected = len(plan.backend_specs(self.scenario))
        model = self.scenario.model
        last_problem = "not checked yet"
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for index, sg in enumerate(self.stargates):
                while True:
                    self.check_alive()
                    try:
                        last_problem = await self._routable_problem(http, sg, index, model, expected)
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        last_problem = f"{type(exc).__name__}: {exc}"
                    if not last_problem:
                        break
                    if time.monotonic() > deadline:
                        raise ProcessError(f"fleet not routable within {self.timeouts.ready_s:g} s: "
                                           f"sg-{index}: {last_problem}\n" + self._all_tails())
                    await asyncio.sleep(self.timeouts.poll_s)

    async def _routable_problem(self, http: aiohttp.ClientSession, sg: StargateAddrs, index: int,
                                model: str, expected: int) -> str:
        async with http.get(f"http://{sg.http}/v1/models") as resp:
            listed = await resp.json(content_type=None) if resp.status == 200 else {}
        if model not in (listed.get("model_ids") or []):
            return f"/v1/models does not list {model!r} yet"
        if sg.metrics is not None:
            async with http.get(f"http://{sg.metrics}/metrics") as resp:
                active = active_servers(await resp.text(), model)
            if active < expected:
                return f"{active} of {expected} backends active"
        probe_id = f"{PROBE_REQUEST_PREFIX}-{index}"
        body = orjson.dumps({"model": model, "stream": True, "max_tokens": 1,
                             "messages": [{"role": "user", "content": "benchmark-ready"}]})
        headers = {"content-type": "application/json", h.REQUEST_ID: probe_id, h.MODEL: model,
                   h.INPUT_TOKENS: "15", h.OUTPUT_TOKENS: "1",
                   h.CACHE_AFFINITY_KEY: f"{PROBE_CACHE_KEY_PREFIX}-{index}"}
        async with http.post(f"http://{sg.http}/v1/chat/completions", data=body, headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                return f"probe request answered {resp.status}"
        return ""

    def _all_tails(self) -> str:
        return "\n".join(p.log_tail(15) for p in self._procs)

    async def scrape(self, label: str) -> None:
        """Save each Stargate's and Pylon's /metrics text as ``metrics-<label>-<name>.prom``."""
        targets = [(f"sg-{i}", sg.metrics) for i, sg in enumerate(self.stargates)]
        targets += [(f"pylon-{bid}", p.metrics) for bid, p in self.pylons.items()]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            for name, addr in targets:
                if addr is None:
                    continue
                try:
                    async with http.get(f"http://{addr}/metrics") as resp:
                        text = await resp.text()
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    text = f"# scrape failed: {type(exc).__name__}: {exc}\n"
                (self.run_dir / f"metrics-{label}-{name}.prom").write_text(text)

    async def stop(self) -> None:
        procs, self._procs = self._procs, []
        self._by_role.clear()
        await stop_all(procs, self.timeouts.stop_grace_s)


_ACTIVE = re.compile(r"^(?:\w+_)?active_inference_servers\{([^}]*)\}\s+([0-9.eE+-]+)", re.MULTILINE)


def active_servers(metrics_text: str, model: str) -> int:
    """Largest ``*active_inference_servers`` gauge for ``model`` over routing keys (0 if absent)."""
    best = 0.0
    needle = f'model="{model}"'
    for labels, value in _ACTIVE.findall(metrics_text):
        if needle in labels:
            best = max(best, float(value))
    return int(best)
