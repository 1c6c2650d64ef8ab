"""Command-line flags → one frozen ``PylonSettings`` (spec pylon.md §2).

Every validation of §2 "Startup validation errors" happens here; a bad value raises
``ConfigError`` naming the offending flag(s). Each flag declares its default once, in
:func:`build_parser`; every ``--pylon-*`` flag (and ``--auth-token``/``--auth-token-file``) takes
its default from an environment variable when set, read from an injected mapping so parsing is a
pure function.
"""

from __future__ import annotations

import argparse
import base64
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import unquote

from stargate.errors import ConfigError
from stargate.flags import FlagSet, non_negative_int, parse_bool, port, positive_int
from stargate.pylon.registration import TOKEN_RULE, bearer_token
from stargate.wire import headers as h
from stargate.wire.address import dial_url, is_dialable, is_ip, split_host_port, unbracket
from stargate.wire.http_client import ENGINE_KEEPALIVE_S
from stargate.wire.limits import MAX_BODY_BYTES, MAX_BUFFERED_BODY_BYTES

DEFAULT_HEALTH_PATHS = ("/health", "/v1/health/ready")
SERVICE_NAME = "pylon"
MAX_ENGINE_CONNECTIONS = 4096
"""Connections to the engine for relayed requests (``--max-engine-connections``); Pylon's own
requests (health probes, canaries, the stats stream, pollers) have connections of their own."""
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
T = TypeVar("T")


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
    """Built only by :func:`parse_settings`: the flags hold the defaults, once each."""

    upstream_base_url: str
    upstream_authorization: str | None  # the URL's credentials (HTTP Basic), in no URL a log shows
    http_listen_host: str
    http_listen_port: int
    http_advertise_addr: str | None
    model_names: tuple[str, ...]
    discovery_poll_interval_ms: int
    discovery_request_timeout_ms: int
    stargate_addresses: tuple[str, ...]
    inference_server_id: str
    cluster_id: str
    disable_bringup: bool
    health_paths: tuple[str, ...]
    health_wait_ms: int
    do_calibration: bool
    initial_input_tps: float | None
    pin_input_tps: bool
    canary_interval_ms: int
    canary_max_generation_threshold: int
    calibration_requests: int
    calibration_prompt_units: int
    calibration_max_concurrency: int
    bringup_timeout_ms: int
    calibration_step_timeout_ms: int
    kv_cache_stats_url: str | None
    stats_stream_mode: StatsStreamMode
    stats_stream_url: str
    stats_source: StatsSource
    engine_metrics_url: str
    engine_metrics_interval_ms: int
    min_update_interval_ms: int
    stats_update_coalesce_ms: int
    engine_prefix_caching: bool
    auth_token: str | None
    auth_token_file: str | None
    metrics_host: str
    metrics_port: int
    retryable_statuses: frozenset[int]
    require_upstream_retry_header: bool
    upstream_retry_header: str
    propagate_retry_after: bool
    local_connect_failures_retryable: bool
    queue_mismatch_enabled: bool
    queue_mismatch_min_delta_ms: int
    queue_mismatch_tolerance_factor: float
    queue_mismatch_retry_after_ms: int | None
    upstream_backend: UpstreamBackend
    priority_ceiling: int
    max_engine_concurrency: int | None
    max_engine_connections: int
    engine_keepalive_ms: int
    relay_non_streaming: bool
    otel_endpoint: str | None
    otel_service_name: str
    http_header_read_timeout_ms: int
    http_body_read_timeout_ms: int
    http_send_timeout_ms: int
    max_buffered_body_bytes: int
    log_level: str


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


def _checked(convert: Callable[[str], T], check: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    """An argparse type: ``convert`` the trimmed text, then reject values failing ``check``."""

    def parse(raw: str) -> T:
        try:
            value = convert(raw.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {raw!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {raw!r}")
        return value

    return parse


_finite_positive = _checked(float, lambda v: math.isfinite(v) and v > 0, "finite and > 0")
_ip = _checked(unbracket, is_ip, "an IP address")
_non_blank = _checked(str, bool, "not blank")
_backend = _checked(lambda v: UpstreamBackend(v.lower()), bool, "dynamo or passthrough")


def _token(raw: str) -> str:
    """The token trimmed (as a token file is); the value is never quoted back."""
    if not raw.strip():
        return ""
    token = bearer_token(raw)
    if token is None:
        raise argparse.ArgumentTypeError(TOKEN_RULE)
    return token


def _base_url(raw: str) -> tuple[str, str | None]:
    """The URL without its ``user:password@`` and those as an HTTP Basic ``Authorization`` value.

    Request targets are appended to it, so a query or fragment would land before their paths, and
    a host:port aiohttp cannot send to made every request a 500: both are refused here."""
    scheme, _, rest = raw.strip().rstrip("/").partition("://")
    default_port = {"http": 80, "https": 443}.get(scheme.lower())
    if default_port is None:
        raise argparse.ArgumentTypeError("must be an http:// or https:// URL")
    authority, slash, path = rest.partition("/")
    userinfo, at, host_port = authority.rpartition("@")
    base = f"{scheme.lower()}://{host_port}{slash}{path}"
    has_port = ":" in host_port and not host_port.endswith("]")
    target = host_port if has_port else f"{host_port}:{default_port}"
    if not is_dialable(target) or "?" in base or "#" in base:
        # Quoted without anything before an @: a password with an unencoded / reads as a path.
        shown = f"{scheme}://...@{rest.rpartition('@')[2]}" if "@" in base else base
        raise argparse.ArgumentTypeError(
            f"expected http(s)://HOST[:PORT][/PATH] with an IPv6 host in brackets, a port of 1-65535 "
            f"and no query, got {shown!r}"
        )
    if not at:
        return base, None
    user, _, password = userinfo.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
    return base, f"Basic {token}"


def _model_id(raw: str) -> str:
    """A model id Stargate accepts in a registration (one a request can name)."""
    model_id = raw.strip()
    problem = h.model_id_problem(model_id)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return model_id


def _identity(field: str, *, blank: bool = False) -> Callable[[str], str]:
    """An identity Stargate accepts as a registration's ``field``: any other is refused by every
    Stargate, and the registration retried for ever. With ``blank`` an empty value stays empty (the
    flag's default applies: ``--cluster-id "$CLUSTER"`` with the variable unset)."""

    def parse(raw: str) -> str:
        if blank and not raw.strip():
            return ""
        value = _non_blank(raw)
        problem = h.identity_problem(field, value)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


DEFAULT_STARGATE_ADDRESS = "127.0.0.1:50071"


def _stargate_url(raw: str) -> str:
    """``host:port`` or ``http(s)://host:port`` (https = TLS), the channel's target."""
    try:
        url = dial_url(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url if "://" in url else f"http://{url}"


def _advertise_addr(raw: str) -> str:
    """``host:port`` Stargate dials (a name or an IP, port 1-65535): registered as ``http://host:port``."""
    if not is_dialable(raw.strip()):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port of 1-65535, got {raw!r}")
    return raw.strip()


_at_least_one = _checked(int, lambda v: v >= 1, "an integer >= 1")
_prompt_units = _checked(int, lambda v: v >= 256, "an integer >= 256")


def _listen_addr(raw: str) -> tuple[str, int]:
    try:
        host, port = split_host_port(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IP:port, got {raw!r}") from None
    if not is_ip(host):
        raise argparse.ArgumentTypeError(f"host must be an IP address, got {host!r}")
    return host, port


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING or ERROR, got {raw!r}")
    return level


def _header_name(raw: str) -> str:
    name = raw.strip().lower()
    if not _HEADER_NAME.match(name):
        raise argparse.ArgumentTypeError(f"invalid header name {name!r}")
    return name


def parse_status_codes(raw: str) -> frozenset[int]:
    codes: set[int] = set()
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        if not entry.isdigit() or not 100 <= int(entry) <= 599:
            raise argparse.ArgumentTypeError(f"invalid status code {entry!r}")
        codes.add(int(entry))
    return frozenset(codes)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog="pylon",
        allow_abbrev=False,
        description="Per-engine sidecar for the Stargate LLM request router.",
    )
    flags = FlagSet(p, env or {})
    a = flags.add

    def pylon(flag: str, **kw: Any) -> None:
        a(flag, env_var=flag.removeprefix("--").replace("-", "_").upper(), **kw)

    a("--upstream-http-base-url", type=_base_url, required=True,
      help="engine base URL: http(s)://[user:password@]host[:port][/path]")
    a("--http-listen-addr", type=_listen_addr, default="127.0.0.1:0",
      help="where Stargate sends requests (IP:port, port 0 ok)")
    a("--http-header-read-timeout-ms", type=non_negative_int, default=10_000,
      help="close a connection whose request head is not complete in this time; 0 disables")
    a("--http-body-read-timeout-ms", type=non_negative_int, default=60_000,
      help="close a connection whose request body sends nothing for this long; 0 disables")
    a("--http-send-timeout-ms", type=non_negative_int, default=60_000,
      help="close a connection whose client reads nothing of the answer for this long; 0 disables")
    a("--max-buffered-body-bytes", type=non_negative_int, default=MAX_BUFFERED_BODY_BYTES,
      help=f"request body bytes held in memory at once, all requests together; 0 = no cap, else "
      f"at least {MAX_BODY_BYTES} (one body)")
    a("--http-advertise-addr", type=_advertise_addr, default=None,
      help="host:port registered with Stargate (default: bound addr)")
    a("--model-name", type=_model_id, action="append", default=[],
      help="static model (repeatable); none = discovery")
    a("--model-discovery-provider", choices=["dynamo"], default="dynamo",
      help="model discovery provider (only dynamo)")
    a("--model-discovery-poll-interval-ms", type=positive_int, default=5000, help="discovery poll period")
    a("--model-discovery-request-timeout-ms", type=positive_int, default=5000, help="discovery poll timeout")
    a("--stargate-address", type=_stargate_url, action="append", default=[],
      help="seed Stargate for WatchStargates (repeatable: a seed that is down does not keep Pylon "
           f"from the others; default {DEFAULT_STARGATE_ADDRESS})")
    a("--inference-server-id", type=_identity("inference_server_id"), default="pylon",
      help="backend identity registered with Stargate")
    a("--cluster-id", type=_identity("cluster_id", blank=True), default=None,
      help="cluster identity (default: the inference server id)")
    a("--disable-bringup", action="store_true", help="no canaries and no startup health probe")
    a("--upstream-health-path", action="append", default=[], help="health path tried first (repeatable)")
    a("--upstream-health-wait-ms", type=non_negative_int, default=60000,
      help="startup health re-probing; 0 = once")
    a("--do-calibration", action="store_true", help="run the input-TPS calibration ramp before registering")
    a("--initial-input-tps", type=_finite_positive, default=None, help="bootstrap input TPS of every model")
    a("--benchmark-pin-input-tps", action="store_true", help=argparse.SUPPRESS)
    a("--active-canary-interval-ms", type=non_negative_int, default=5000,
      help="canary period; 0 disables canaries")
    a("--canary-max-generation-threshold", type=_at_least_one, default=237,
      help="canary max_tokens; reached = runaway")
    a("--calibration-requests", type=int, default=5, help="requests of the first calibration step")
    a("--calibration-prompt-units", type=_prompt_units, default=4096,
      help="largest calibration prompt (chars, >= 256)")
    a("--calibration-max-concurrency", type=_at_least_one, default=4, help="calibration requests in flight")
    a("--bringup-canary-timeout-ms", type=non_negative_int, default=5000,
      help="canary and health probe timeout")
    a("--bringup-calibration-timeout-ms", type=non_negative_int, default=30000,
      help="timeout of one calibration step")
    a("--kv-cache-stats-path", default=None, help="engine path of JSON KV-cache stats, polled every 1 s")
    a("--engine-stats-stream", type=StatsStreamMode, choices=list(StatsStreamMode), default="auto",
      help="NDJSON stats stream")
    a("--engine-stats-stream-path", default="/pylon/v1/stats/stream", help="engine path of the stats stream")
    a("--engine-stats-source", type=StatsSource, choices=list(StatsSource), default="stream",
      help="stream (NDJSON) or prometheus (engine /metrics)")
    a("--engine-metrics-path", default="/metrics", help="engine Prometheus path (prometheus source)")
    a("--engine-metrics-interval-ms", type=positive_int, default=1000, help="engine /metrics poll period")
    a("--min-update-interval-ms", type=positive_int, default=1000, help="registration heartbeat period")
    a("--stats-update-coalesce-ms", type=non_negative_int, default=0,
      help="send the snapshot this long after a load change (0 = heartbeats only; 10 recommended)")
    a("--engine-prefix-caching", type=parse_bool, default=False, metavar="BOOL",
      help="the engine keeps prompts' KV cache: a request's prompt work is what the last prompt of its "
      "cache-affinity key here did not cover (false = every input token, as the spec says)")
    a("--auth-token", env_var="STARGATE_AUTH_TOKEN", default=None, type=_token,
      help="bearer token for Stargate")
    a("--auth-token-file", env_var="STARGATE_AUTH_TOKEN_FILE", default=None,
      help="token file, re-read per stream")
    a("--otel-endpoint", env_var="OTEL_EXPORTER_OTLP_ENDPOINT", default=None,
      help="OTLP/HTTP base URL for request spans")
    a("--otel-service-name", env_var="OTEL_SERVICE_NAME", default=SERVICE_NAME,
      help="service.name of exported spans")
    a("--metrics-host", type=_ip, default="0.0.0.0", help="Prometheus listener IP")
    a("--metrics-port", type=port, default=9089, help="Prometheus listener port (0 = any)")
    pylon("--pylon-retryable-upstream-status-codes", type=parse_status_codes, default="429,503",
          help="engine statuses that may be retried")
    pylon("--pylon-require-upstream-retry-header", type=parse_bool, default=True, metavar="BOOL",
          help="retryable statuses need the engine's retry header")
    pylon("--pylon-upstream-retry-header", type=_header_name, default=h.UPSTREAM_RETRYABLE,
          help="engine header allowing a retry")
    pylon("--pylon-propagate-retry-after", type=parse_bool, default=True, metavar="BOOL",
          help="turn engine Retry-After into x-stargate-retry-after-ms")
    pylon("--pylon-local-connect-failures-retryable", type=parse_bool, default=True, metavar="BOOL",
          help="mark engine connection failures (nothing was sent, so nothing ran) retryable")
    pylon("--pylon-relay-non-streaming", type=parse_bool, default=False, metavar="BOOL",
          help="relay chat/responses without stream=true as JSON (OpenAI clients); false = 400 "
          "as the spec says")
    pylon("--pylon-queue-mismatch-retry-enabled", type=parse_bool, default=True, metavar="BOOL",
          help="local queue admission (429 queue_estimate_mismatch)")
    pylon("--pylon-queue-mismatch-min-delta-ms", type=non_negative_int, default=25,
          help="additive admission tolerance in ms")
    pylon("--pylon-queue-mismatch-tolerance-factor", type=_finite_positive, default=1.25,
          help="multiplicative admission tolerance")
    pylon("--pylon-queue-mismatch-retry-after-ms", type=non_negative_int, default=None,
          help="x-stargate-retry-after-ms on admission rejections; unset = no header")
    pylon("--pylon-upstream-backend", type=_backend, default="dynamo",
          help="dynamo (priority headers) or passthrough")
    pylon("--pylon-priority-ceiling", type=non_negative_int, default=3600,
          help="dynamo priority band ceiling")
    a("--max-engine-concurrency", type=positive_int, default=None,
      help="engine slots per model until the engine reports its own")
    a("--max-engine-connections", type=non_negative_int, default=MAX_ENGINE_CONNECTIONS,
      help="connections to the engine for relayed requests, one per request in flight (a request "
      "past them waits for one); 0 = no limit")
    a("--engine-keepalive-ms", type=positive_int, default=round(ENGINE_KEEPALIVE_S * 1000),
      help="an idle connection to the engine is closed after this long: keep it below the engine's "
      "own idle timeout (uvicorn's, vLLM's and SGLang's server, is 5 s), or a request sent on one "
      "the engine is closing is lost unread")
    a("--log-level", env_var="PYLON_LOG_LEVEL", type=_log_level, default="INFO", help="logging to stderr")
    return p


def _join(base: str, path: str) -> str:
    return base + "/" + path.lstrip("/")


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


def _check_combinations(ns: argparse.Namespace) -> None:
    if ns.do_calibration and ns.initial_input_tps is not None:
        raise ConfigError("mutually exclusive", path="--do-calibration/--initial-input-tps")
    if ns.benchmark_pin_input_tps and ns.initial_input_tps is None:
        raise ConfigError("requires --initial-input-tps", path="--benchmark-pin-input-tps")
    if ns.do_calibration and ns.calibration_requests <= 0:
        raise ConfigError("must be > 0 with --do-calibration", path="--calibration-requests")
    if ns.auth_token_file and not ns.auth_token:
        try:  # read again whenever a stream opens (a rotated secret); unreadable at start is a typo
            raw = Path(ns.auth_token_file).read_bytes()
        except OSError as exc:
            reason = f"cannot read {ns.auth_token_file}: {exc.strerror or exc}"
            raise ConfigError(reason, path="--auth-token-file") from exc
        if raw.strip() and bearer_token(raw) is None:
            reason = f"{ns.auth_token_file} holds no usable token: {TOKEN_RULE}"
            raise ConfigError(reason, path="--auth-token-file")
    if 0 < ns.max_buffered_body_bytes < MAX_BODY_BYTES:
        raise ConfigError(
            f"must be 0 or at least {MAX_BODY_BYTES} (one body)", path="--max-buffered-body-bytes"
        )


def parse_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> PylonSettings:
    ns = build_parser(env).parse_args(list(argv))
    _check_combinations(ns)
    base, authorization = ns.upstream_http_base_url
    listen_host, listen_port = ns.http_listen_addr
    seeds = tuple(dict.fromkeys(ns.stargate_address)) or (_stargate_url(DEFAULT_STARGATE_ADDRESS),)
    return PylonSettings(
        upstream_base_url=base,
        upstream_authorization=authorization,
        http_listen_host=listen_host,
        http_listen_port=listen_port,
        http_advertise_addr=(ns.http_advertise_addr or "").strip() or None,
        model_names=tuple(sorted(set(ns.model_name))),
        discovery_poll_interval_ms=ns.model_discovery_poll_interval_ms,
        discovery_request_timeout_ms=ns.model_discovery_request_timeout_ms,
        stargate_addresses=seeds,
        inference_server_id=ns.inference_server_id,
        cluster_id=ns.cluster_id or ns.inference_server_id,
        disable_bringup=ns.disable_bringup,
        health_paths=health_candidates(ns.upstream_health_path),
        health_wait_ms=ns.upstream_health_wait_ms,
        do_calibration=ns.do_calibration,
        initial_input_tps=ns.initial_input_tps,
        pin_input_tps=ns.benchmark_pin_input_tps,
        canary_interval_ms=ns.active_canary_interval_ms,
        canary_max_generation_threshold=ns.canary_max_generation_threshold,
        calibration_requests=ns.calibration_requests,
        calibration_prompt_units=ns.calibration_prompt_units,
        calibration_max_concurrency=ns.calibration_max_concurrency,
        bringup_timeout_ms=ns.bringup_canary_timeout_ms,
        calibration_step_timeout_ms=ns.bringup_calibration_timeout_ms,
        kv_cache_stats_url=_join(base, ns.kv_cache_stats_path) if ns.kv_cache_stats_path else None,
        stats_stream_mode=ns.engine_stats_stream,
        stats_stream_url=base + ns.engine_stats_stream_path,
        stats_source=ns.engine_stats_source,
        engine_metrics_url=_join(base, ns.engine_metrics_path),
        engine_metrics_interval_ms=ns.engine_metrics_interval_ms,
        min_update_interval_ms=ns.min_update_interval_ms,
        stats_update_coalesce_ms=ns.stats_update_coalesce_ms,
        engine_prefix_caching=ns.engine_prefix_caching,
        auth_token=ns.auth_token or None,
        auth_token_file=ns.auth_token_file or None,
        otel_endpoint=ns.otel_endpoint or None,
        otel_service_name=ns.otel_service_name or SERVICE_NAME,  # a blank variable means the default
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        retryable_statuses=ns.pylon_retryable_upstream_status_codes,
        require_upstream_retry_header=ns.pylon_require_upstream_retry_header,
        upstream_retry_header=ns.pylon_upstream_retry_header,
        propagate_retry_after=ns.pylon_propagate_retry_after,
        local_connect_failures_retryable=ns.pylon_local_connect_failures_retryable,
        relay_non_streaming=ns.pylon_relay_non_streaming,
        queue_mismatch_enabled=ns.pylon_queue_mismatch_retry_enabled,
        queue_mismatch_min_delta_ms=ns.pylon_queue_mismatch_min_delta_ms,
        queue_mismatch_tolerance_factor=ns.pylon_queue_mismatch_tolerance_factor,
        queue_mismatch_retry_after_ms=ns.pylon_queue_mismatch_retry_after_ms,
        upstream_backend=ns.pylon_upstream_backend,
        priority_ceiling=ns.pylon_priority_ceiling,
        max_engine_concurrency=ns.max_engine_concurrency,
        max_engine_connections=ns.max_engine_connections,
        engine_keepalive_ms=ns.engine_keepalive_ms,
        http_header_read_timeout_ms=ns.http_header_read_timeout_ms,
        http_body_read_timeout_ms=ns.http_body_read_timeout_ms,
        http_send_timeout_ms=ns.http_send_timeout_ms,
        max_buffered_body_bytes=ns.max_buffered_body_bytes,
        log_level=ns.log_level,
    )
