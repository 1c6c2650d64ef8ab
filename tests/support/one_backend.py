"""A real one-backend fleet for integration tests: one Stargate, one mock engine, one Pylon, each a
child process on loopback, stopped when the context ends. Tests pass the flags they are about."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from stargate.bench.fleet import (
    StargateAddrs,
    command,
    parse_engine_ready,
    parse_pylon_ready,
    parse_stargate_ready,
)
from stargate.bench.procs import ManagedProcess, stop_all

MODEL = "llama"
READY_TIMEOUT_S = 20.0
RECOMMENDED = Path(__file__).resolve().parents[2] / "examples" / "lb-config" / "recommended.json"


def recommended_with(**fields: object) -> dict[str, Any]:
    """``examples/lb-config/recommended.json`` for ``MODEL`` with ``fields`` changed."""
    config = json.loads(RECOMMENDED.read_text())
    (settings,) = config["models"].values()
    config["models"] = {MODEL: {**settings, **fields}}
    return config


@dataclass(frozen=True)
class Fleet:
    stargate: StargateAddrs
    engine_url: str

    async def cluster(self, http: aiohttp.ClientSession) -> dict[str, Any] | None:
        """The model's one cluster in ``/debug/routing`` (None before a backend is routable)."""
        async with http.get(f"http://{self.stargate.http}/debug/routing") as resp:
            body = await resp.json()
        clusters = [c for t in body["targets"] if t["model_id"] == MODEL for c in t["clusters"]]
        return clusters[0] if clusters else None


@asynccontextmanager
async def one_backend(
    tmp_path: Path, lb_config: dict[str, Any], engine_flags: list[str], pylon_flags: list[str]
) -> AsyncIterator[Fleet]:
    path = tmp_path / "lb-config.json"
    path.write_text(json.dumps(lb_config))
    procs: list[ManagedProcess[Any]] = []

    async def launch(proc: ManagedProcess[Any]) -> Any:
        procs.append(proc)
        await proc.start()
        return await proc.wait_ready(READY_TIMEOUT_S)

    try:
        stargate = await launch(ManagedProcess("stargate", [
            *command("stargate"), "--stargate-id", "sg-0", "--listen-addr", "127.0.0.1:0",
            "--advertise-addr", "127.0.0.1:0", "--model-discovery-listen-addr", "127.0.0.1:0",
            "--http-listen-addr", "127.0.0.1:0", "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--disable-dns-discovery", "--lb-config-path", str(path),
        ], tmp_path, parse_stargate_ready))  # fmt: skip
        engine = await launch(ManagedProcess("engine", [
            *command("stargate-mock-engine"), "--http-listen-addr", "127.0.0.1:0", "--model-name", MODEL,
            *engine_flags,
        ], tmp_path, parse_engine_ready))  # fmt: skip
        await launch(ManagedProcess("pylon", [
            *command("pylon"), "--upstream-http-base-url", engine, "--stargate-address", stargate.grpc,
            "--inference-server-id", "pylon-a", "--http-listen-addr", "127.0.0.1:0",
            "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--model-name", MODEL, *pylon_flags,
        ], tmp_path, parse_pylon_ready))  # fmt: skip
        yield Fleet(stargate, engine)
    finally:
        await stop_all(procs, grace_s=3.0)
