"""``stargate-mock-engine``: command line, event loop and signal handling.

Prints ``stargate-mock-engine listening on http://HOST:PORT`` on stdout once bound (port 0 picks a
free port) and shuts down cleanly on SIGTERM/SIGINT. Usage errors exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from stargate.flags import FlagSet
from stargate.flags import port as port_number
from stargate.wire import runner
from stargate.wire.address import join_host_port, split_ip_port

from .app import start_server
from .engine import Engine, EngineConfig
from .timing import BATCHING_MODES, TimingConfig

parse_listen_addr = split_ip_port
"""``IP:PORT`` or ``[IPv6]:PORT``; raises ValueError otherwise."""

LISTEN_LINE = "stargate-mock-engine listening on "
_E = EngineConfig()
_T = TimingConfig()
"""Every flag's default is the config's own: written once, in ``EngineConfig``/``TimingConfig``."""
log = logging.getLogger("stargate.mock_engine")


def _non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from exc
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
        return value

    return parse


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Flags through ``FlagSet``: one default each, shown once by ``--help``."""
    p = argparse.ArgumentParser(
        prog="stargate-mock-engine", description="Mock OpenAI-compatible inference engine."
    )
    a = FlagSet(p, env or {}).add
    a("--http-listen-addr", default="127.0.0.1:8090", help="IP:PORT to listen on (port 0: any)")
    a("--host", help="listen host (overrides the host of --http-listen-addr)")
    a("--port", type=port_number, help="listen port (overrides the port of --http-listen-addr)")
    a("--model-name", "--model", dest="model", default=_E.model, help="model id served")
    a(
        "--backend-id",
        help="engine identity in x-mock-backend-id and system_fingerprint (default MODEL/PORT)",
    )
    a("--num-tokens", type=int, default=_T.num_tokens, help="default and maximum output tokens")
    a("--token-delay-ms", type=_non_negative(float), default=_T.token_delay_ms, help="decode time per token")
    a("--decode-tokens-per-s", type=_non_negative(float), help="sets --token-delay-ms to 1000/TPS")
    a(
        "--decode-jitter-ms",
        type=_non_negative(int),
        default=_T.decode_jitter_ms,
        help="extra delay per token, 0 to this (deterministic per request)",
    )
    a("--ttft-ms", type=_non_negative(float), default=_T.ttft_ms, help="base time to first token")
    a(
        "--ttft-jitter-ms",
        type=_non_negative(int),
        default=_T.ttft_jitter_ms,
        help="extra delay on TTFT, 0 to this (deterministic per request)",
    )
    a(
        "--prefill-tokens-per-s",
        type=_non_negative(float),
        default=_T.prefill_tokens_per_s,
        help="prefill speed of uncached tokens; 0 = free",
    )
    a(
        "--batching",
        choices=BATCHING_MODES,
        default=_T.batching,
        help="continuous: concurrent requests share prefill throughput and slow each other's decode; "
        "vllm: engine steps with a token budget, FCFS admission and chunked prefill",
    )
    a(
        "--max-num-batched-tokens",
        type=int,
        default=_T.max_num_batched_tokens,
        help="vllm: token budget of one engine step (decode tokens first, then prefill chunks)",
    )
    a(
        "--decode-slowdown",
        type=_non_negative(float),
        default=_T.decode_slowdown,
        help="continuous: extra fraction of the token delay per additional decoding request",
    )
    a(
        "--max-concurrent-requests",
        type=_non_negative(int),
        default=_E.max_concurrent_requests,
        help="engine slots; 0 = unlimited",
    )
    a(
        "--max-waiting-requests",
        type=_non_negative(int),
        default=_E.max_waiting_requests,
        help="queue cap; beyond it 429 (retryable)",
    )
    a(
        "--health-delay-ms",
        type=_non_negative(float),
        default=_E.health_delay_ms,
        help="latency of GET /health",
    )
    a(
        "--kv-cache-capacity-tokens",
        type=_non_negative(int),
        default=_E.kv_cache_capacity_tokens,
        help="0 disables the cache",
    )
    a(
        "--kv-cache-mode",
        choices=("affinity", "prefix"),
        default=_E.kv_cache_mode,
        help="key the cache by x-cache-affinity-key, or by hashed blocks of the prompt text",
    )
    a("--kv-block-size", type=int, default=_E.kv_block_size, help="prefix mode: tokens per cached block")
    a("--request-log", metavar="FILE", help="append one JSON line per request")
    a("--arrival-log", metavar="FILE", help="append one JSON line per request as it arrives, unbuffered")
    a("--responses-stream-only", action="store_true", help="answer 400 to non-streaming /v1/responses")
    a("--max-body-bytes", type=int, default=_E.max_body_bytes, help="larger bodies get 413")
    a(
        "--max-model-len",
        type=int,
        default=_E.max_model_len,
        help="longest prompt in tokens (x-input-tokens, else estimated); longer ones get 400",
    )
    a("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log verbosity")
    return p


def config_from_args(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[EngineConfig, str, int]:
    args = parser.parse_args(argv)
    try:
        host, port = parse_listen_addr(args.http_listen_addr)
    except ValueError:
        parser.error(f"--http-listen-addr: not an IP:PORT socket address: {args.http_listen_addr!r}")
    if args.host is not None:
        host = args.host
    if args.port is not None:
        if not 0 <= args.port <= 65535:
            parser.error("--port: must be in [0, 65535]")
        port = args.port
    if args.kv_block_size < 1:
        parser.error("--kv-block-size: must be >= 1")
    if args.max_num_batched_tokens < 1:
        parser.error("--max-num-batched-tokens: must be >= 1")
    if args.max_body_bytes < 1024:
        parser.error("--max-body-bytes: must be >= 1024")
    if args.max_model_len < 1:
        parser.error("--max-model-len: must be >= 1")
    for flag, path in (("--request-log", args.request_log), ("--arrival-log", args.arrival_log)):
        if path:
            try:
                open(path, "ab").close()  # the engine appends to it: created here if missing
            except OSError as exc:
                parser.error(f"{flag}: cannot open {path}: {exc.strerror or exc}")
    token_delay = args.token_delay_ms
    if args.decode_tokens_per_s is not None:
        if not args.decode_tokens_per_s > 0:
            parser.error("--decode-tokens-per-s: must be > 0")
        token_delay = 1000.0 / args.decode_tokens_per_s
    timing = TimingConfig(
        num_tokens=args.num_tokens,
        token_delay_ms=token_delay,
        decode_jitter_ms=args.decode_jitter_ms,
        ttft_ms=args.ttft_ms,
        ttft_jitter_ms=args.ttft_jitter_ms,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        batching=args.batching,
        decode_slowdown=args.decode_slowdown,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    config = EngineConfig(
        model=args.model,
        backend_id=args.backend_id or "",
        timing=timing,
        max_concurrent_requests=args.max_concurrent_requests,
        max_waiting_requests=args.max_waiting_requests,
        health_delay_ms=args.health_delay_ms,
        kv_cache_capacity_tokens=args.kv_cache_capacity_tokens,
        kv_cache_mode=args.kv_cache_mode,
        kv_block_size=args.kv_block_size,
        request_log=args.request_log,
        arrival_log=args.arrival_log,
        responses_stream_only=args.responses_stream_only,
        max_body_bytes=args.max_body_bytes,
        max_model_len=args.max_model_len,
    )
    runner.configure_logging(args.log_level.upper())
    return config, host, port


async def serve(config: EngineConfig, host: str, port: int) -> int:
    """Serves until SIGTERM/SIGINT; 2 (a usage error: the address is the operator's to change)
    when it cannot listen."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner.ignore_hangup(loop, log)
    try:
        engine = Engine(config)
        app_runner, url = await start_server(engine, host, port)
    except OSError as exc:
        reason = f"cannot listen on {join_host_port(host, port)}: {exc.strerror or exc}"
        print(f"stargate-mock-engine: error: --http-listen-addr/--host/--port: {reason}", file=sys.stderr)
        return 2
    print(LISTEN_LINE + url, flush=True)
    log.info("serving model %s as %s", config.model, engine.backend_id)
    try:
        await stop.wait()
    finally:
        await app_runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    config, host, port = config_from_args(build_parser(os.environ), argv)
    try:
        return runner.run(serve(config, host, port))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
