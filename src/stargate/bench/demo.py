"""``stargate-bench demo``: the quickest way to see the router work on one machine.

Runs ``benches/demo.yaml`` (1 Stargate, 4 Pylons, 4 mock engines, a mixed workload) for
``--duration`` seconds per algorithm and prints the results table and the report path. With
``--serve`` it then starts a fresh fleet in plain-client mode and keeps it up until Ctrl-C,
printing its ``OPENAI_BASE_URL`` and a ``curl`` command that streams one request through it.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
from pathlib import Path

import orjson
from rich.console import Console

from stargate.bench import plan
from stargate.bench.console import (
    EXIT_OK,
    RichProgress,
    benches_dir,
    print_result,
    resolve_scenario,
    run_async,
)
from stargate.bench.fleet import Fleet
from stargate.bench.runner import run_suite
from stargate.bench.schema import Scenario, load_scenario
from stargate.bench.workload import build_workload
from stargate.errors import ConfigError

DEMO_SCENARIO = "demo.yaml"


def demo_scenario(value: str | None, duration_s: float) -> Scenario:
    if value is not None:
        path = resolve_scenario(value)
    else:
        path = benches_dir() / DEMO_SCENARIO
        if not path.is_file():
            raise ConfigError(f"the demo scenario {path} is missing", path="--scenario")
    sc = load_scenario(path)
    base = sc.base_dir
    sc = sc.model_copy(update={"execution": sc.execution.model_copy(update={"duration_s": duration_s})})
    sc._base_dir = base
    return sc


def curl_command(base_url: str, model: str) -> str:
    """A copy-pasteable streaming request as any OpenAI client sends it (plain-client mode)."""
    body = orjson.dumps({"model": model, "stream": True, "max_tokens": 8, "user": "demo-session",
                         "messages": [{"role": "user", "content": "Hello from the demo"}]}).decode()
    parts = ["curl", "-sN", "-i", f"{base_url}/chat/completions", "-H", "content-type: application/json",
             "-d", body]
    return " ".join(shlex.quote(p) for p in parts)


async def serve(console: Console, sc: Scenario, out_dir: Path) -> None:
    """Keep one fleet (the first algorithm's) up in plain-client mode until cancelled."""
    run = plan.with_plain_clients(plan.runs(sc)[0])
    console.print(f"starting a fleet for [bold]{run.name}[/bold] ...", highlight=False)
    async with Fleet(sc, run, out_dir / "serve") as fleet:
        base_url = f"http://{fleet.stargates[0].http}/v1"
        console.print(f"fleet ready: {len(fleet.stargates)} Stargate, {len(fleet.pylons)} Pylons, "
                      f"{len(fleet.engines)} mock engines; logs in {fleet.log_dir}", highlight=False)
        console.print(f"OPENAI_BASE_URL={base_url}  (model {sc.model}; any OpenAI client, no extra headers)",
                      highlight=False, soft_wrap=True)
        console.print("try it (Ctrl-C stops the fleet):", highlight=False)
        console.print(curl_command(base_url, sc.model), highlight=False, soft_wrap=True)
        while True:
            fleet.check_alive()
            await asyncio.sleep(1.0)


def demo_command(console: Console, args: argparse.Namespace) -> int:
    sc = demo_scenario(args.scenario, args.duration)
    if not plan.runs(sc):
        raise ConfigError("the demo scenario has no algorithms", path="$.algorithms")
    out_dir: Path = args.out or Path(".bench-out") / "demo"
    code = EXIT_OK
    if not (args.serve and args.no_workload):
        workload = build_workload(sc)
        with RichProgress(console) as progress:
            result = run_async(run_suite(sc, workload, out_dir, runs=plan.runs(sc), progress=progress,
                                         seed=workload.seed, argv=["stargate-bench", "demo"]))
        code = print_result(console, result)
    if args.serve:
        try:
            run_async(serve(console, sc, out_dir))
        except KeyboardInterrupt:
            console.print("fleet stopped")
    return code
