"""``stargate-bench serve``: a local fleet for any OpenAI client or load tool, up until interrupted.

Starts one Stargate in plain-client mode (``--plain-clients``), one Pylon per mock engine (relaying
non-streaming requests as JSON) and ``--engines`` mock engines, all on 127.0.0.1, waits until every
backend is routable, then prints exactly one line on stdout, ``OPENAI_BASE_URL=http://127.0.0.1:PORT/v1``,
so a script can ``eval`` or grep it. Progress and the log directory go to stderr. SIGINT and SIGTERM
stop every process of the fleet and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from stargate.balancer.config import load_lb_config
from stargate.bench.fleet import Fleet
from stargate.bench.peers.compare import recommended_run
from stargate.bench.plan import RunSpec, with_plain_clients
from stargate.bench.schema import Scenario, parse_scenario
from stargate.flags import FlagSet, parse_bool, positive_int

EXIT_OK = 0
DEFAULT_MODEL = "mock-model"
DEFAULT_MAX_OUTPUT_TOKENS = 1024
CHECK_INTERVAL_S = 1.0


def add_parser(sub: Any, env: Mapping[str, str]) -> None:
    help_text = "a local fleet for OpenAI clients: prints OPENAI_BASE_URL=... once ready, Ctrl-C stops"
    a = FlagSet(sub.add_parser("serve", help=help_text), env).add
    a("--engines", type=positive_int, default=2, help="mock engines, one Pylon each")
    a("--lb-config", type=Path, default=None,
      help="lb-config.json for Stargate, run with no other flag (default: the recommended deployment: "
           "examples/lb-config/recommended.json for --model, with the router and Pylon flags "
           "docs/configuration.md recommends)")
    a("--model", default=DEFAULT_MODEL, help="model the engines serve")
    a("--max-concurrent-requests", type=positive_int, default=16, help="slots per mock engine")
    a("--max-output-tokens", type=positive_int, default=DEFAULT_MAX_OUTPUT_TOKENS,
      help="tokens the engines answer a request that sets no max_tokens with, and the most any request "
           "gets (the mock engine's --num-tokens)")
    a("--batching", choices=("independent", "continuous", "vllm"), default="independent",
      help="the engines' compute model (docs/mock-engine.md): independent requests, continuous batching "
           "with shared prefill, or vLLM-style steps with a token budget")
    a("--kv-cache-mode", choices=("prefix", "affinity"), default="prefix",
      help="the engines' KV cache: prefix = by prompt text, as engines cache (default); affinity = by "
           "the x-cache-affinity-key each request reaches the engine with")
    a("--plain-clients", type=parse_bool, default=True, metavar="BOOL",
      help="plain-client mode on Stargate and Pylon (false = the spec's header contract, for comparisons)")
    a("--out", type=Path, default=Path(".bench-out") / "serve", help="directory for the fleet's logs")


def serve_scenario(engines: int, model: str, slots: int, kv_mode: str = "prefix",
                   batching: str = "independent") -> Scenario:
    """A fleet of ``engines`` fast mock engines; the workload fields are unused (nothing is replayed)."""
    profile = {
        "name": "serve",
        "max_concurrent_requests": slots,
        "kv_cache_capacity_tokens": 200_000,
        "service_time_ms": {"ttft_mean": 20, "decode_tokens_per_s": 200, "prefill_tokens_per_s": 20_000},
        "registration": {"last_mean_input_tps": 20_000},
    }
    data = {
        "name": "serve",
        "model": model,
        "request_count": 1,
        "max_concurrency": 1,
        "backends": {"count": engines, "profile": profile},
        "mock": {"kv_mode": kv_mode, "batching": batching},
        "traffic_pattern": {
            "kind": "uniform",
            "input_tokens": {"distribution": "constant", "value": 16},
            "output_tokens": {"distribution": "constant", "value": 16},
            "arrival": {"distribution": "constant", "interval_ms": 1000},
        },
    }
    return parse_scenario(data, file="stargate-bench serve", base_dir=Path.cwd())


def serve_run(scenario: Scenario, path: Path | None, plain: bool) -> RunSpec:
    """The recommended deployment, or the file's JSON as given (validated first, so errors name
    the file and the field); plus the plain-client flags."""
    if path is None:
        run = recommended_run(scenario, streaming=False)  # any client: many do not stream
    else:
        load_lb_config(str(path))
        run = RunSpec("serve", orjson.loads(path.read_bytes()), [])
    if not plain:
        return run
    return with_plain_clients(run)


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    """Run the fleet until ``stop`` is set or SIGINT/SIGTERM arrives."""
    scenario = serve_scenario(args.engines, args.model, args.max_concurrent_requests, args.kv_cache_mode,
                              args.batching)
    run = serve_run(scenario, args.lb_config, bool(args.plain_clients))
    # A client's max_tokens can only shorten the mock's default answer; scenarios keep the short
    # default because their requests carry x-output-tokens, a client here sends max_tokens.
    answers = ["--num-tokens", str(args.max_output_tokens)]
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"starting 1 Stargate, {args.engines} Pylons and {args.engines} mock engines "
          f"(model {args.model}; logs in {args.out / 'logs'}) ...", file=sys.stderr, flush=True)
    try:
        async with Fleet(scenario, run, args.out, engine_args=answers) as fleet:
            print(f"OPENAI_BASE_URL=http://{fleet.stargates[0].http}/v1", flush=True)
            print("ready; Ctrl-C stops the fleet", file=sys.stderr, flush=True)
            while not stop.is_set():
                fleet.check_alive()
                try:
                    await asyncio.wait_for(stop.wait(), CHECK_INTERVAL_S)
                except TimeoutError:
                    continue
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print("fleet stopped", file=sys.stderr, flush=True)
    return EXIT_OK
