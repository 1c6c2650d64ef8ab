"""Router adapters: what sits between the bench client and the mock engines in one run.

A ``RouterAdapter`` is attached to a fleet that is already up (mock engines; plus Stargate and its
Pylons for the ``stargate`` kind) and gives the driver its ``urls`` and, per planned request, the
headers that router can use (fairness rule: the strongest signal it consumes, §16.3):

* ``stargate:<algorithm>`` — the workload's own headers (``x-cache-affinity-key``, ``x-routing-key``,
  ``x-input-tokens``, ``x-output-tokens``); Stargate and Pylons are the fleet's processes.
* ``stargate-plain:<algorithm>`` — what a plain OpenAI client sends (``x-request-id`` and the body,
  as sglang-router gets); Stargate runs in plain-client mode and reads the rest from the body.
* ``sglang:<policy>`` (sglang-router 0.3.x) — prompt text only: it forwards ``x-request-id`` and the
  body and drops every other request header; ``cache_aware`` matches the prompt text in its radix
  tree, ``power_of_two`` polls the engines' ``/get_load``.
* ``vllm:<policy>`` (vllm-router 0.1.x) — ``consistent_hash`` keys on ``X-Session-ID`` first
  (then ``X-User-ID``, ``X-Tenant-ID``, ``X-Request-ID``), so the session or cache-affinity key is sent
  as ``x-session-id``; ``cache_aware`` matches prompt text.
* ``direct`` — no router: the client spreads requests round-robin over the engines.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import aiohttp

from stargate.bench.fleet import Fleet
from stargate.bench.peers.install import PeerPackage, ensure_installed, installed, script_path
from stargate.bench.peers.nodelay import preload_env
from stargate.bench.procs import ManagedProcess, stop_all
from stargate.bench.workload import PlannedRequest
from stargate.errors import ConfigError, ProcessError
from stargate.wire import headers as h

Kind = Literal["stargate", "sglang", "vllm", "direct"]

SGLANG = PeerPackage("sglang-router", "0.3.2", "sglang-router")
VLLM = PeerPackage("vllm-router", "0.1.17", "vllm-router")
PACKAGES: dict[str, PeerPackage] = {"sglang": SGLANG, "vllm": VLLM}
POLICIES: dict[str, tuple[str, ...]] = {
    "sglang": ("cache_aware", "power_of_two", "round_robin"),
    "vllm": ("cache_aware", "consistent_hash", "round_robin"),
    "direct": ("round_robin",),
}
SIGNALS: dict[str, str] = {
    "stargate": "headers: x-cache-affinity-key, x-routing-key, x-input-tokens, x-output-tokens",
    "stargate-plain": "prompt text only (plain-client mode): x-request-id and the body",
    "sglang:cache_aware": "prompt text (radix-tree prefix match); other request headers are dropped",
    "sglang:power_of_two": "engine load from /get_load",
    "sglang:round_robin": "none",
    "vllm:cache_aware": "prompt text (radix-tree prefix match)",
    "vllm:consistent_hash": "x-session-id header = session / cache-affinity key",
    "vllm:round_robin": "none",
    "direct": "none (client-side round robin over the engines)",
}


PLAIN_CLIENT_HEADERS = frozenset({"content-type", h.REQUEST_ID})
"""What a ``stargate-plain`` run's client sends: the request id only so the engines' ground truth
can be matched to the client's records (sglang-router forwards it too)."""


class RouterAdapter(Protocol):
    label: str
    kind: Kind
    signal: str

    @property
    def urls(self) -> list[str]: ...

    async def attach(self, fleet: Fleet, log_dir: Path) -> None: ...

    def request_headers(self, req: PlannedRequest) -> dict[str, str]: ...

    def router_pids(self) -> dict[str, int]: ...

    async def stop(self) -> None: ...


def free_port() -> int:
    """An ephemeral loopback port for routers that cannot bind port 0 and report it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class StargateAdapter:
    kind: Kind = "stargate"

    def __init__(self, label: str, *, pylons_in_path: bool = True, plain: bool = False) -> None:
        self.label = label
        self.signal = SIGNALS["stargate-plain" if plain else "stargate"]
        self.pylons_in_path = pylons_in_path  # False: Pylons only register, requests skip them
        self.plain = plain  # send what a plain OpenAI client sends, not the workload's headers
        self._fleet: Fleet | None = None

    @property
    def urls(self) -> list[str]:
        return self._fleet.stargate_urls if self._fleet else []

    async def attach(self, fleet: Fleet, log_dir: Path) -> None:
        self._fleet = fleet

    def request_headers(self, req: PlannedRequest) -> dict[str, str]:
        if self.plain:
            return {k: v for k, v in req.headers.items() if k in PLAIN_CLIENT_HEADERS}
        return req.headers

    def router_pids(self) -> dict[str, int]:
        pids = self._fleet.pids() if self._fleet else {}
        kinds = ("stargate-", "pylon-") if self.pylons_in_path else ("stargate-",)
        return {name: pid for name, pid in pids.items() if name.startswith(kinds)}

    async def stop(self) -> None:
        self._fleet = None


class DirectAdapter:
    kind: Kind = "direct"

    def __init__(self, label: str = "direct") -> None:
        self.label = label
        self.signal = SIGNALS["direct"]
        self._urls: list[str] = []

    @property
    def urls(self) -> list[str]:
        return self._urls

    async def attach(self, fleet: Fleet, log_dir: Path) -> None:
        self._urls = [f"{url}/v1/chat/completions" for url in fleet.engines.values()]

    def request_headers(self, req: PlannedRequest) -> dict[str, str]:
        return req.headers

    def router_pids(self) -> dict[str, int]:
        return {}

    async def stop(self) -> None:
        self._urls = []


@dataclass(frozen=True)
class PeerTimeouts:
    ready_s: float = 60.0
    poll_s: float = 0.2
    stop_grace_s: float = 5.0


def _first_line(line: str) -> bool | None:
    return True if line.strip() else None  # unused for readiness; ManagedProcess wants a parser


class PeerRouterAdapter:
    """sglang-router or vllm-router in its own venv, in front of the fleet's engines."""

    def __init__(self, kind: Kind, policy: str, tokenizer_dir: Path, *,
                 peers_root: Path | None = None, install: bool = True, nodelay: bool = False,
                 timeouts: PeerTimeouts | None = None) -> None:
        if kind not in PACKAGES:
            raise ConfigError(f"{kind!r} is not a peer router", path="--routers")
        self.kind: Kind = kind
        self.policy = policy
        self.label = f"{kind}:{policy}"
        self.signal = SIGNALS[self.label]
        self.package = PACKAGES[kind]
        self.tokenizer_dir = tokenizer_dir
        self.peers_root = peers_root
        self.install = install
        self.nodelay = nodelay and kind == "sglang"  # only sglang-router leaves Nagle on (measured)
        if self.nodelay:
            self.signal += "; run with the TCP_NODELAY accept shim"
        self.timeouts = timeouts or PeerTimeouts()
        self.port = 0
        self._proc: ManagedProcess[bool] | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.port}/v1/chat/completions"] if self._proc else []

    def script(self) -> Path:
        if self.install:
            return ensure_installed(self.package, self.peers_root)
        if not installed(self.package, self.peers_root):
            raise ProcessError(f"{self.package.requirement} is not installed (use --install-peers)")
        return script_path(self.package, self.peers_root)

    def argv(self, script: Path, workers: Sequence[str], port: int, metrics_port: int) -> list[str]:
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                  "--policy", self.policy, "--prometheus-host", "127.0.0.1",
                  "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
                  "--health-check-interval-secs", "5", "--disable-retries"]
        if self.kind == "sglang":
            return [str(script), "launch", *common, "--model-path", str(self.tokenizer_dir),
                    "--tokenizer-path", str(self.tokenizer_dir), "--log-level", "warn"]
        return [str(script), *common, "--log-level", "warning"]

    def env(self) -> dict[str, str]:
        env = {**os.environ, "RUST_LOG": "warn", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        if self.nodelay:
            env.update(preload_env(self.tokenizer_dir.parent))
        return env

    async def attach(self, fleet: Fleet, log_dir: Path) -> None:
        script = await asyncio.to_thread(self.script)
        workers = list(fleet.engines.values())
        self.port, metrics = free_port(), free_port()
        argv = self.argv(script, workers, self.port, metrics)
        self._proc = ManagedProcess(self.label.replace(":", "-"), argv, log_dir, _first_line, env=self.env())
        await self._proc.start()
        await self.wait_ready(len(workers))  # readiness is polled over HTTP: these routers log no ready line

    async def wait_ready(self, expected: int) -> None:
        """``GET /workers`` lists ``expected`` healthy workers."""
        deadline = time.monotonic() + self.timeouts.ready_s
        problem = "not checked yet"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as http:
            while True:
                if self._proc is not None and self._proc.returncode is not None:
                    raise ProcessError(f"{self.label} exited with code {self._proc.returncode}\n"
                                       f"{self._proc.log_tail()}")
                try:
                    async with http.get(f"http://127.0.0.1:{self.port}/workers") as resp:
                        body = await resp.json(content_type=None) if resp.status == 200 else {}
                    healthy = sum(1 for w in body.get("workers", []) if w.get("is_healthy"))
                    if healthy >= expected:
                        return
                    problem = f"{healthy} of {expected} workers healthy"
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    tail = self._proc.log_tail() if self._proc else ""
                    raise ProcessError(f"{self.label} not ready within {self.timeouts.ready_s:g} s: "
                                       f"{problem}\n{tail}")
                await asyncio.sleep(self.timeouts.poll_s)

    def request_headers(self, req: PlannedRequest) -> dict[str, str]:
        if self.label != "vllm:consistent_hash":
            return req.headers
        key = req.session or req.cache_affinity_key or req.request_id
        return {**req.headers, h.SESSION_ID: key}

    def router_pids(self) -> dict[str, int]:
        pid = self._proc.pid if self._proc else None
        return {self.label: pid} if pid is not None else {}

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            await stop_all([proc], self.timeouts.stop_grace_s)


def parse_router_label(text: str) -> tuple[Kind, str]:
    """``stargate:<name>``, ``stargate-plain:<name>``, ``sglang:<policy>``, ``vllm:<policy>`` or
    ``direct``."""
    head, _, rest = text.strip().partition(":")
    kinds: dict[str, Kind] = {"stargate": "stargate", "stargate-plain": "stargate", "sglang": "sglang",
                              "vllm": "vllm", "direct": "direct"}
    kind = kinds.get(head)
    if kind == "direct" and rest in ("", "round_robin"):
        return "direct", "round_robin"
    if kind == "stargate" and rest:
        return "stargate", rest
    if kind == "sglang" or kind == "vllm":
        if rest in POLICIES[kind]:
            return kind, rest
        raise ConfigError(f"unknown {kind} policy {rest!r}; expected one of: {', '.join(POLICIES[kind])}",
                          path="--routers")
    raise ConfigError(f"unknown router {text!r}; expected stargate:<algorithm>, "
                      "stargate-plain:<algorithm>, sglang:<policy>, vllm:<policy> or direct",
                      path="--routers")


def is_plain_label(text: str) -> bool:
    """A ``stargate-plain:`` label: Stargate in plain-client mode, sent what a plain client sends."""
    return text.strip().partition(":")[0] == "stargate-plain"
