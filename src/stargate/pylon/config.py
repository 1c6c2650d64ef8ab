"""Command-line flags → one frozen ``PylonSettings`` (spec pylon.md §2).

Every validation of §2 "Startup validation errors" happens here; a bad value raises
``ConfigError`` whose ``path`` names the offending flag(s). Environment fallbacks are read from
an injected mapping so parsing is a pure function.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NoReturn

from stargate.errors import ConfigError

DEFAULT_HEALTH_PATHS = ("/health", "/v1/health/ready")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


class StatsStreamMode(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"
    OFF = "off"


class StatsSource(StrEnum):
    """Where engine throughput/capacity numbers come from."""

    STREAM = "stream"
    PROMETHEUS = "prometheus"


class UpstreamBackend(StrEnum):
    DYNAMO = "dynamo"
    PASSTHROUGH = "passthrough"


@dataclass(frozen=True, slots=True)
class PylonSettings:
    upstream_base_url: str
    http_listen_host: str = "127.0.0.1"
    http_listen_port: int = 0
    http_advertise_addr: str | None = None
    model_names: tuple[str, ...] = ()
    discovery_poll_interval_ms: int = 5000
    discovery_request_timeout_ms: int = 5000
    stargate_address: str = "http://127.0.0.1:50071"
    inference_server_id: str = "pylon"
    cluster_id: str = "pylon"
    disable_bringup: bool = False
    health_paths: tuple[str, ...] = DEFAULT_HEALTH_PATHS
    health_wait_ms: int = 60000
    do_calibration: bool = False
    initial_input_tps: float | None = None
    pin_input_tps: bool = False
    canary_interval_ms: int = 5000
    canary_max_generation_threshold: int = 237
    calibration_requests: int = 5
    calibration_prompt_units: int = 4096
    calibration_max_concurrency: int = 4
    bringup_timeout_ms: int = 5000
    calibration_step_timeout_ms: int = 30000
    kv_cache_stats_url: str | None = None
    stats_stream_mode: StatsStreamMode = StatsStreamMode.AUTO
    stats_stream_url: str = ""
    stats_source: StatsSource = StatsSource.STREAM
    engine_metrics_url: str = ""
    engine_metrics_interval_ms: int = 1000
    min_update_interval_ms: int = 1000
    auth_token: str | None = None
    auth_token_file: str | None = None
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9089
    retryable_statuses: frozenset[int] = frozenset({429, 503})
    require_upstream_retry_header: bool = True
    upstream_retry_header: str = "x-stargate-upstream-retryable"
    propagate_retry_after: bool = True
    local_connect_failures_retryable: bool = True
    queue_mismatch_enabled: bool = True
    queue_mismatch_min_delta_ms: int = 25
    queue_mismatch_tolerance_factor: float = 1.25
    queue_mismatch_retry_after_ms: int | None = None
    upstream_backend: UpstreamBackend = UpstreamBackend.DYNAMO
    priority_ceiling: int = 3600
    max_engine_concurrency: int | None = None
    relay_non_streaming: bool = False
    otel_endpoint: str | None = None
    otel_service_name: str = "pylon"

    @property
    def discovery_mode(self) -> bool:
        return not self.model_names

    @property
    def probing_enabled(self) -> bool:
        return self.do_calibration or not self.disable_bringup

    @property
    def fallback_stats_at_start(self) -> bool:
        return self.stats_source is StatsSource.PROMETHEUS or self.stats_stream_mode is StatsStreamMode.OFF


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: …)`` unless there is none to show (unset, a switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pylon",
        allow_abbrev=False,
        description="Per-engine sidecar for the Stargate LLM request router.",
        formatter_class=_HelpFormatter,
    )
    a = p.add_argument
    a("--upstream-http-base-url", required=True, help="engine base URL (http:// or https://)")
    a("--http-listen-addr", default="127.0.0.1:0", help="where Stargate sends requests (IP:port, port 0 ok)")
    a("--http-advertise-addr", default=None, help="host:port registered with Stargate (default: bound addr)")
    a("--model-name", action="append", default=[], help="static model (repeatable); none = discovery")
    a("--model-discovery-provider", default="dynamo", help="model discovery provider (only dynamo)")
    a("--model-discovery-poll-interval-ms", type=int, default=5000, help="discovery poll period (> 0)")
    a("--model-discovery-request-timeout-ms", type=int, default=5000, help="discovery poll timeout (> 0)")
    a("--stargate-address", default="127.0.0.1:50071", help="seed Stargate for WatchStargates")
    a("--inference-server-id", default="pylon", help="backend identity registered with Stargate")
    a("--cluster-id", default=None, help="cluster identity (default: the inference server id)")
    a("--disable-bringup", action="store_true", help="no canaries and no startup health probe")
    a("--upstream-health-path", action="append", default=[], help="health path tried first (repeatable)")
    a("--upstream-health-wait-ms", type=int, default=60000, help="startup health re-probing; 0 = once")
    a("--do-calibration", action="store_true", help="run the input-TPS calibration ramp before registering")
    a("--initial-input-tps", type=float, default=None, help="bootstrap input TPS of every model (> 0)")
    a("--benchmark-pin-input-tps", action="store_true", help=argparse.SUPPRESS)
    a("--active-canary-interval-ms", type=int, default=5000, help="canary period; 0 disables canaries")
    a("--canary-max-generation-threshold", type=int, default=237, help="canary max_tokens; reached = runaway")
    a("--calibration-requests", type=int, default=5, help="requests of the first calibration step")
    a("--calibration-prompt-units", type=int, default=4096, help="largest calibration prompt (chars, >= 256)")
    a("--calibration-max-concurrency", type=int, default=4, help="calibration requests in flight")
    a("--bringup-canary-timeout-ms", type=int, default=5000, help="canary and health probe timeout")
    a("--bringup-calibration-timeout-ms", type=int, default=30000, help="timeout of one calibration step")
    a("--kv-cache-stats-path", default=None, help="engine path of JSON KV-cache stats, polled every 1 s")
    a("--engine-stats-stream", default="auto", help="NDJSON stats stream: auto, required or off")
    a("--engine-stats-stream-path", default="/pylon/v1/stats/stream", help="engine path of the stats stream")
    a("--engine-stats-source", default="stream", help="stream (NDJSON) or prometheus (engine /metrics)")
    a("--engine-metrics-path", default="/metrics", help="engine Prometheus path (prometheus source)")
    a("--engine-metrics-interval-ms", type=int, default=1000, help="engine /metrics poll period")
    a("--min-update-interval-ms", type=int, default=1000, help="registration heartbeat period")
    a("--auth-token", default=None, help="bearer token for Stargate (env STARGATE_AUTH_TOKEN)")
    a("--auth-token-file", default=None, help="token file, re-read per stream (env STARGATE_AUTH_TOKEN_FILE)")
    a(
        "--otel-endpoint",
        default=None,
        help="OTLP/HTTP base URL for request spans (env OTEL_EXPORTER_OTLP_ENDPOINT)",
    )
    a(
        "--otel-service-name",
        default=None,
        help="service.name of exported spans (env OTEL_SERVICE_NAME; pylon)",
    )
    a("--metrics-host", default="0.0.0.0", help="Prometheus listener IP")
    a("--metrics-port", type=int, default=9089, help="Prometheus listener port (0 = any)")
    a(
        "--pylon-retryable-upstream-status-codes",
        default=None,
        help="engine statuses that may be retried (default: 429,503)",
    )
    a(
        "--pylon-require-upstream-retry-header",
        type=_bool,
        default=None,
        help="retryable statuses need the engine's retry header (default: true)",
    )
    a(
        "--pylon-upstream-retry-header",
        default=None,
        help="engine header allowing a retry (default: x-stargate-upstream-retryable)",
    )
    a(
        "--pylon-propagate-retry-after",
        type=_bool,
        default=None,
        help="turn engine Retry-After into x-stargate-retry-after-ms (default: true)",
    )
    a(
        "--pylon-local-connect-failures-retryable",
        type=_bool,
        default=None,
        help="mark engine connection failures (nothing was sent, so nothing ran) retryable "
        "(default: true)",
    )
    a(
        "--pylon-relay-non-streaming",
        type=_bool,
        default=None,
        help="relay chat/responses without stream=true as JSON (OpenAI clients); false = 400 "
        "as the spec says (default: false)",
    )
    a(
        "--pylon-queue-mismatch-retry-enabled",
        type=_bool,
        default=None,
        help="local queue admission (429 queue_estimate_mismatch) (default: true)",
    )
    a(
        "--pylon-queue-mismatch-min-delta-ms",
        type=int,
        default=None,
        help="additive admission tolerance in ms (default: 25)",
    )
    a(
        "--pylon-queue-mismatch-tolerance-factor",
        type=float,
        default=None,
        help="multiplicative admission tolerance (default: 1.25)",
    )
    a(
        "--pylon-queue-mismatch-retry-after-ms",
        type=int,
        default=None,
        help="x-stargate-retry-after-ms on admission rejections (default: none)",
    )
    a(
        "--pylon-upstream-backend",
        default=None,
        help="dynamo (priority headers) or passthrough (default: dynamo)",
    )
    a("--pylon-priority-ceiling", type=int, default=None, help="dynamo priority band ceiling (default: 3600)")
    a(
        "--max-engine-concurrency",
        type=int,
        default=None,
        help="engine slots per model until the engine reports its own (> 0)",
    )
    p.epilog = "Each --pylon-* flag falls back to the environment variable of the same name in capitals."
    return p


def _join(base: str, path: str) -> str:
    return base + "/" + path.lstrip("/")


def _split_host_port(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"expected IP:port, got {value!r}", path=flag)
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(f"host must be an IP address, got {host!r}", path=flag) from exc
    return host, int(port)


def parse_status_codes(raw: str) -> frozenset[int]:
    codes: set[int] = set()
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        if not entry.isdigit() or not 100 <= int(entry) <= 999:
            raise ConfigError(
                f"invalid status code {entry!r}", path="--pylon-retryable-upstream-status-codes"
            )
        codes.add(int(entry))
    return frozenset(codes)


def health_candidates(configured: Sequence[str]) -> tuple[str, ...]:
    """Configured paths (trimmed, ``/``-prefixed, blanks dropped) then the defaults, deduplicated."""
    out: list[str] = []
    for raw in [*configured, *DEFAULT_HEALTH_PATHS]:
        path = raw.strip()
        if not path:
            continue
        path = path if path.startswith("/") else "/" + path
        if path not in out:
            out.append(path)
    return tuple(out)


def _env_or(value: object, env: Mapping[str, str], key: str) -> object:
    return value if value is not None else env.get(key)


def parse_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> PylonSettings:
    env = env or {}
    ns = build_parser().parse_args(list(argv))
    base = ns.upstream_http_base_url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError("must be an http:// or https:// URL", path="--upstream-http-base-url")
    if ns.model_discovery_provider != "dynamo":
        raise ConfigError("only 'dynamo' is supported", path="--model-discovery-provider")
    models = []
    for name in ns.model_name:
        if not name.strip():
            raise ConfigError("model name must not be blank", path="--model-name")
        models.append(name.strip())
    for flag, value in (
        ("--model-discovery-poll-interval-ms", ns.model_discovery_poll_interval_ms),
        ("--model-discovery-request-timeout-ms", ns.model_discovery_request_timeout_ms),
        ("--min-update-interval-ms", ns.min_update_interval_ms),
        ("--engine-metrics-interval-ms", ns.engine_metrics_interval_ms),
    ):
        if value <= 0:
            raise ConfigError("must be > 0", path=flag)
    if ns.do_calibration and ns.initial_input_tps is not None:
        raise ConfigError("mutually exclusive", path="--do-calibration/--initial-input-tps")
    tps = ns.initial_input_tps
    if tps is not None and not (math.isfinite(tps) and tps > 0):
        raise ConfigError("must be finite and > 0", path="--initial-input-tps")
    if ns.benchmark_pin_input_tps and tps is None:
        raise ConfigError("requires --initial-input-tps", path="--benchmark-pin-input-tps")
    if ns.do_calibration and ns.calibration_requests <= 0:
        raise ConfigError("must be > 0 with --do-calibration", path="--calibration-requests")
    for flag, value in (
        ("--upstream-health-wait-ms", ns.upstream_health_wait_ms),
        ("--active-canary-interval-ms", ns.active_canary_interval_ms),
        ("--bringup-canary-timeout-ms", ns.bringup_canary_timeout_ms),
        ("--bringup-calibration-timeout-ms", ns.bringup_calibration_timeout_ms),
    ):
        if value < 0:
            raise ConfigError("must be >= 0", path=flag)
    try:
        mode = StatsStreamMode(ns.engine_stats_stream)
    except ValueError as exc:
        raise ConfigError("must be auto, required or off", path="--engine-stats-stream") from exc
    try:
        source = StatsSource(ns.engine_stats_source)
    except ValueError as exc:
        raise ConfigError("must be stream or prometheus", path="--engine-stats-source") from exc
    if ns.max_engine_concurrency is not None and ns.max_engine_concurrency <= 0:
        raise ConfigError("must be a positive integer", path="--max-engine-concurrency")
    listen_host, listen_port = _split_host_port(ns.http_listen_addr, "--http-listen-addr")
    try:
        ipaddress.ip_address(ns.metrics_host)
    except ValueError as exc:
        raise ConfigError(f"must be an IP address, got {ns.metrics_host!r}", path="--metrics-host") from exc
    if not 0 <= ns.metrics_port <= 65535:
        raise ConfigError("must be a port number", path="--metrics-port")

    raw_codes = _env_or(
        ns.pylon_retryable_upstream_status_codes, env, "PYLON_RETRYABLE_UPSTREAM_STATUS_CODES"
    )
    codes = parse_status_codes(str(raw_codes)) if raw_codes is not None else frozenset({429, 503})
    retry_header = (
        str(
            _env_or(ns.pylon_upstream_retry_header, env, "PYLON_UPSTREAM_RETRY_HEADER")
            or "x-stargate-upstream-retryable"
        )
        .strip()
        .lower()
    )
    if not _HEADER_NAME.match(retry_header):
        raise ConfigError(f"invalid header name {retry_header!r}", path="--pylon-upstream-retry-header")
    factor = _env_float(
        ns.pylon_queue_mismatch_tolerance_factor, env, "PYLON_QUEUE_MISMATCH_TOLERANCE_FACTOR"
    )
    factor = 1.25 if factor is None else factor
    if not (math.isfinite(factor) and factor > 0):
        raise ConfigError("must be finite and > 0", path="--pylon-queue-mismatch-tolerance-factor")
    backend_raw = str(_env_or(ns.pylon_upstream_backend, env, "PYLON_UPSTREAM_BACKEND") or "dynamo")
    try:
        backend = UpstreamBackend(backend_raw.strip().lower())
    except ValueError as exc:
        raise ConfigError("must be dynamo or passthrough", path="--pylon-upstream-backend") from exc
    ceiling = _env_int(ns.pylon_priority_ceiling, env, "PYLON_PRIORITY_CEILING")
    min_delta = _env_int(ns.pylon_queue_mismatch_min_delta_ms, env, "PYLON_QUEUE_MISMATCH_MIN_DELTA_MS")
    retry_after = _env_int(ns.pylon_queue_mismatch_retry_after_ms, env, "PYLON_QUEUE_MISMATCH_RETRY_AFTER_MS")
    for flag, value in (
        ("--pylon-priority-ceiling", ceiling),
        ("--pylon-queue-mismatch-min-delta-ms", min_delta),
        ("--pylon-queue-mismatch-retry-after-ms", retry_after),
    ):
        if value is not None and value < 0:
            raise ConfigError("must be >= 0", path=flag)
    stargate = ns.stargate_address.strip()
    if not stargate:
        raise ConfigError("must not be blank", path="--stargate-address")
    if "://" not in stargate:
        stargate = "http://" + stargate
    kv = ns.kv_cache_stats_path
    return PylonSettings(
        upstream_base_url=base,
        http_listen_host=listen_host,
        http_listen_port=listen_port,
        http_advertise_addr=(ns.http_advertise_addr or "").strip() or None,
        model_names=tuple(sorted(set(models))),
        discovery_poll_interval_ms=ns.model_discovery_poll_interval_ms,
        discovery_request_timeout_ms=ns.model_discovery_request_timeout_ms,
        stargate_address=stargate,
        inference_server_id=ns.inference_server_id,
        cluster_id=ns.cluster_id or ns.inference_server_id,
        disable_bringup=ns.disable_bringup,
        health_paths=health_candidates(ns.upstream_health_path),
        health_wait_ms=ns.upstream_health_wait_ms,
        do_calibration=ns.do_calibration,
        initial_input_tps=tps,
        pin_input_tps=ns.benchmark_pin_input_tps,
        canary_interval_ms=ns.active_canary_interval_ms,
        canary_max_generation_threshold=ns.canary_max_generation_threshold,
        calibration_requests=ns.calibration_requests,
        calibration_prompt_units=ns.calibration_prompt_units,
        calibration_max_concurrency=ns.calibration_max_concurrency,
        bringup_timeout_ms=ns.bringup_canary_timeout_ms,
        calibration_step_timeout_ms=ns.bringup_calibration_timeout_ms,
        kv_cache_stats_url=_join(base, kv) if kv else None,
        stats_stream_mode=mode,
        stats_stream_url=base + ns.engine_stats_stream_path,
        stats_source=source,
        engine_metrics_url=_join(base, ns.engine_metrics_path),
        engine_metrics_interval_ms=ns.engine_metrics_interval_ms,
        min_update_interval_ms=ns.min_update_interval_ms,
        auth_token=_str_env(ns.auth_token, env, "STARGATE_AUTH_TOKEN"),
        auth_token_file=_str_env(ns.auth_token_file, env, "STARGATE_AUTH_TOKEN_FILE"),
        otel_endpoint=_str_env(ns.otel_endpoint, env, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        otel_service_name=_str_env(ns.otel_service_name, env, "OTEL_SERVICE_NAME") or "pylon",
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        retryable_statuses=codes,
        require_upstream_retry_header=_env_bool(
            ns.pylon_require_upstream_retry_header, env, "PYLON_REQUIRE_UPSTREAM_RETRY_HEADER", True
        ),
        upstream_retry_header=retry_header,
        propagate_retry_after=_env_bool(
            ns.pylon_propagate_retry_after, env, "PYLON_PROPAGATE_RETRY_AFTER", True
        ),
        local_connect_failures_retryable=_env_bool(
            ns.pylon_local_connect_failures_retryable, env, "PYLON_LOCAL_CONNECT_FAILURES_RETRYABLE", True
        ),
        relay_non_streaming=_env_bool(ns.pylon_relay_non_streaming, env, "PYLON_RELAY_NON_STREAMING", False),
        queue_mismatch_enabled=_env_bool(
            ns.pylon_queue_mismatch_retry_enabled, env, "PYLON_QUEUE_MISMATCH_RETRY_ENABLED", True
        ),
        queue_mismatch_min_delta_ms=25 if min_delta is None else min_delta,
        queue_mismatch_tolerance_factor=factor,
        queue_mismatch_retry_after_ms=retry_after,
        upstream_backend=backend,
        priority_ceiling=3600 if ceiling is None else ceiling,
        max_engine_concurrency=ns.max_engine_concurrency,
    )


def _str_env(value: str | None, env: Mapping[str, str], key: str) -> str | None:
    raw = value if value is not None else env.get(key)
    return raw if raw else None


def _env_bool(value: bool | None, env: Mapping[str, str], key: str, default: bool) -> bool:
    if value is not None:
        return value
    raw = env.get(key)
    if raw is None:
        return default
    try:
        return _bool(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(str(exc), path=key) from exc


def _env_int(value: int | None, env: Mapping[str, str], key: str) -> int | None:
    if value is not None:
        return value
    raw = env.get(key)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip())
    except ValueError as exc:
        raise ConfigError(f"expected an integer, got {raw!r}", path=key) from exc


def _env_float(value: float | None, env: Mapping[str, str], key: str) -> float | None:
    if value is not None:
        return value
    raw = env.get(key)
    if raw is None or not raw.strip():
        return None
    try:
        return float(raw.strip())
    except ValueError as exc:
        raise ConfigError(f"expected a number, got {raw!r}", path=key) from exc
