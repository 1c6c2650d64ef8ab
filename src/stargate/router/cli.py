"""``stargate`` service command line (spec §7): flags, environment variables, lifecycle.

Flags marked for a single-machine deployment are honoured; QUIC/Kubernetes flags are accepted
only where they are trivial (informational values, remote watch seeds). Configuration errors exit
with status 2 and name the flag or file; SIGTERM/SIGINT drain the router (``/readyz`` 503) and
shut it down within ``--shutdown-drain-timeout-ms`` (exit 1 when exceeded; a second signal exits
at once). Once every listener is bound a single parseable line is printed on stdout:
``stargate ready grpc=H:P discovery=H:P http=H:P metrics=H:P``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from stargate.balancer.config import LbConfig, load_lb_config
from stargate.errors import ConfigError
from stargate.flags import FlagSet, non_negative_int, parse_bool, port, positive_int
from stargate.router.app import StargateServer, StargateSettings
from stargate.router.attempt import RetrySettings
from stargate.router.discovery_cli import add_discovery_flags, discovery_settings
from stargate.router.headers import MAX_WAIT_CAP_MS, valid_header_name
from stargate.router.plain_client import (
    PlainClientSettings,
)
from stargate.router.proxy import ProxySettings
from stargate.wire import runner
from stargate.wire.address import dial_url, unbracket

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
TUNNEL_PROTOCOLS = {
    "raw-quic": "raw-quic",
    "http3": "http3",
    "h3": "http3",
    "webtransport": "webtransport",
    "web-transport": "webtransport",
    "wt": "webtransport",
}
log = logging.getLogger("stargate")
_D = StargateSettings(stargate_id="", advertise_addr="")
METRIC_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_PLAIN = PlainClientSettings()
"""Every flag's default is the settings' own: written once, in the settings dataclasses."""


def build_parser(env: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stargate", description="LLM request router.")
    add = FlagSet(p, env).add
    add("--stargate-id", default=None, help="identity in WatchStargates and /debug/state (required)")
    add("--listen-addr", default=_D.listen_addr, help="gRPC control plane address")
    add("--model-discovery-listen-addr", default=_D.model_discovery_listen_addr,
        help="gRPC ListModels address")
    add("--http-listen-addr", default=_D.http_listen_addr, help="HTTP proxy address")
    add(
        "--http-header-read-timeout-ms",
        type=non_negative_int,
        default=_D.http_header_read_timeout_ms,
        help="close a connection whose request head is not complete in this time; 0 disables",
    )
    add(
        "--http-body-read-timeout-ms",
        type=non_negative_int,
        default=_D.http_body_read_timeout_ms,
        help="close a connection whose request body sends nothing for this long; 0 disables",
    )
    add(
        "--http-send-timeout-ms",
        type=non_negative_int,
        default=_D.http_send_timeout_ms,
        help="close a connection whose client reads nothing of the answer for this long; 0 disables",
    )
    add("--advertise-addr", default=None, help="self gRPC address published in discovery (required)")
    add("--metrics-port", type=port, default=_D.metrics_port, help="Prometheus port (HOST:PORT/metrics)")
    add("--metrics-host", default=_D.metrics_host, help="Prometheus bind host")
    add(
        "--shutdown-drain-timeout-ms",
        type=non_negative_int,
        default=_D.shutdown_drain_timeout_ms,
        help="on SIGTERM, how long in-flight requests may finish",
    )
    add("--lb-config-path", default=None, help="lb-config.json; unset = permissive default")
    add(
        "--proxy-max-connect-retries",
        env_var="STARGATE_PROXY_MAX_CONNECT_RETRIES",
        type=non_negative_int,
        default=_D.retry.max_connect_retries,
        help="retries after a backend connect failure",
    )
    add(
        "--proxy-max-request-retries",
        env_var="STARGATE_PROXY_MAX_REQUEST_RETRIES",
        type=non_negative_int,
        default=_D.retry.max_request_retries,
        help="retries after a retryable backend answer",
    )
    add(
        "--proxy-max-replay-body-bytes",
        env_var="STARGATE_PROXY_MAX_REPLAY_BODY_BYTES",
        type=non_negative_int,
        default=_D.proxy.max_replay_body_bytes,
        help="largest request body kept for replay: a larger Content-Length gets 413, "
        "a larger chunked body is sent once, not resent",
    )
    add(
        "--proxy-max-buffered-body-bytes",
        env_var="STARGATE_PROXY_MAX_BUFFERED_BODY_BYTES",
        type=non_negative_int,
        default=_D.proxy.max_buffered_body_bytes,
        help="request body bytes held in memory at once, all requests together (replay buffers, "
        "plain-client reads); 0 = no cap",
    )
    add(
        "--proxy-max-connections-per-backend",
        env_var="STARGATE_PROXY_MAX_CONNECTIONS_PER_BACKEND",
        type=non_negative_int,
        default=_D.backend_connection_limit,
        help="connections to one backend at once, one per request in flight there (a request past "
        "them waits for one); 0 = no limit",
    )
    add(
        "--default-max-wait-ms",
        env_var="STARGATE_DEFAULT_MAX_WAIT_MS",
        type=non_negative_int,
        default=0,
        help="routing wait for requests without x-max-wait-ms (capped at 60000); 0 = the spec's "
        "immediate 503 when nothing is selectable",
    )
    add(
        "--max-held-requests",
        env_var="STARGATE_MAX_HELD_REQUESTS",
        type=non_negative_int,
        default=_D.retry.max_held_requests,
        help=(
            "requests the router holds waiting at once (for room, a registration or a key's prefill);"
            " more get 503 at once (0 = no limit)"
        ),
    )
    add(
        "--proxy-require-pylon-retry-signal",
        env_var="STARGATE_PROXY_REQUIRE_PYLON_RETRY_SIGNAL",
        type=parse_bool,
        default=_D.retry.require_pylon_retry_signal,
        metavar="BOOL",
        help="retry 429/503 only when Pylon marks them x-stargate-retryable",
    )
    add(
        "--proxy-retry-budget-header",
        env_var="STARGATE_PROXY_RETRY_BUDGET_HEADER",
        default=_D.proxy.retry_budget_header,
        help="retry budget header; empty disables budgets",
    )
    add(
        "--registration-update-idle-timeout-ms",
        env_var="STARGATE_REGISTRATION_UPDATE_IDLE_TIMEOUT_MS",
        type=non_negative_int,
        default=_D.registration_idle_timeout_ms,
        help="floor of the registration idle timeout (3 x the Pylon heartbeat); 0 disables",
    )
    add(
        "--registration-update-max-idle-timeout-ms",
        env_var="STARGATE_REGISTRATION_UPDATE_MAX_IDLE_TIMEOUT_MS",
        type=non_negative_int,
        default=_D.registration_max_idle_timeout_ms,
        help="cap of the registration idle timeout; 0 disables",
    )
    add(
        "--stargate-discovery-dns-name",
        default=None,
        help="peer discovery name (not needed with --disable-dns-discovery)",
    )
    add("--disable-dns-discovery", action="store_true", help="self-only WatchStargates")
    add(
        "--remote-stargate-url",
        env_var="STARGATE_REMOTE_WATCH_URLS",
        action="append",
        default=None,
        help="remote watch seed (repeatable, comma-delimited)",
    )
    add(
        "--grpc-pylon-dial-addr",
        default=None,
        help="host:port or http(s)://host:port Pylons dial, written into every StargateInfo",
    )
    add("--dns-poll-ms", type=positive_int, default=_D.discovery.poll_ms, help="peer discovery interval")
    add_discovery_flags(add)
    add("--watch-heartbeat-ms", type=positive_int, default=_D.watch_heartbeat_ms,
        help="WatchStargates resend interval")
    add(
        "--backend-connectivity",
        choices=("direct",),
        default="direct",
        help="only direct connectivity is supported",
    )
    add("--tunnel-protocol", default=_D.tunnel_protocol, help="informational; backends are reached over HTTP")
    add(
        "--direct-quic-connections",
        env_var="STARGATE_DIRECT_QUIC_CONNECTIONS",
        type=positive_int,
        default=_D.direct_quic_connections,
        help="informational",
    )
    add("--quic-connect-timeout-ms", type=positive_int, default=_D.connect_timeout_ms,
        help="backend connect timeout")
    add(
        "--quic-request-timeout-ms",
        type=positive_int,
        default=_D.request_timeout_ms,
        help="time allowed until response headers (and then between body bytes) once the backend has left "
        "routing; one still in routing is waited for another period each time, up to 30 min",
    )
    add("--metrics-prefix", default=_D.metrics_prefix, help="prefix of every Prometheus metric name")
    add(
        "--otel-endpoint",
        env_var="OTEL_EXPORTER_OTLP_ENDPOINT",
        default=None,
        help="OTLP/HTTP base URL: export one span per request to URL/v1/traces (needs the otel extra)",
    )
    add("--otel-service-name", default=_D.otel_service_name, help="service.name of exported spans")
    add("--secrets-path", env_var="SECRETS_PATH", default=None, help="accepted; unused without worker auth")
    add("--secrets-json-path", env_var="SECRETS_JSON_PATH", default="authToken", help="accepted; unused")
    add("--worker-auth-endpoint", default=None, help="not supported: registrations use open authentication")
    add(
        "--plain-clients",
        env_var="STARGATE_PLAIN_CLIENTS",
        type=parse_bool,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help="serve OpenAI clients without a gateway: fill a missing x-request-id, x-model and "
        "x-input-tokens from the request, proxy /v1/completions, OpenAI fields in /v1/models, "
        "/v1/models/{id} and GET /health; off = the spec's header contract exactly",
    )
    add(
        "--plain-client-max-body-bytes",
        type=positive_int,
        default=_PLAIN.max_body_bytes,
        help="largest body read to fill x-model/x-input-tokens; larger ones get 413",
    )
    add(
        "--plain-client-tokenizer",
        default=None,
        help="tokenizer.json (or its directory) counting x-input-tokens; unset = bytes per token",
    )
    add(
        "--plain-client-bytes-per-token",
        type=positive_int,
        default=_PLAIN.bytes_per_token,
        help="x-input-tokens estimate without a tokenizer: ceil(prompt UTF-8 bytes / N)",
    )
    add(
        "--plain-client-session-header",
        default=_PLAIN.session_header,
        help="header whose value is the cache-affinity key when x-cache-affinity-key is absent; "
        "empty disables (the body's prompt_cache_key, then user, is used when the body is read)",
    )
    add(
        "--plain-client-prefix-keys",
        type=parse_bool,
        default=_PLAIN.prefix_keys,
        metavar="BOOL",
        help="a body read without any key: a prompt that starts with a whole earlier prompt (the next "
        "turn of a conversation) gets that prompt's cache-affinity key, other prompts of 512 characters "
        "or more a new one, shorter ones and repeats none",
    )
    return p


def settings_from_args(options: argparse.Namespace) -> StargateSettings:
    """Turn parsed flags into settings; every semantic problem is a ``ConfigError`` naming the flag."""
    for flag, value in (("--stargate-id", options.stargate_id), ("--advertise-addr", options.advertise_addr)):
        if not (value or "").strip():
            raise ConfigError("required to run the router", path=flag)
    if not options.disable_dns_discovery and not (options.stargate_discovery_dns_name or "").strip():
        raise ConfigError(
            "required unless --disable-dns-discovery is set", path="--stargate-discovery-dns-name"
        )
    if options.worker_auth_endpoint:
        raise ConfigError("worker authentication endpoints are not supported", path="--worker-auth-endpoint")
    protocol = TUNNEL_PROTOCOLS.get(options.tunnel_protocol.strip().lower())
    if protocol is None:
        raise ConfigError(f"unknown tunnel protocol {options.tunnel_protocol!r}", path="--tunnel-protocol")
    budget_header = options.proxy_retry_budget_header.strip().lower()
    if budget_header and not valid_header_name(budget_header):
        raise ConfigError(
            f"invalid proxy retry budget header: {options.proxy_retry_budget_header}",
            path="--proxy-retry-budget-header",
        )
    session_header = options.plain_client_session_header.strip().lower()
    if session_header and not valid_header_name(session_header):
        raise ConfigError(
            f"invalid header name: {options.plain_client_session_header}",
            path="--plain-client-session-header",
        )
    buffered = options.proxy_max_buffered_body_bytes
    if buffered and options.plain_clients and buffered < options.plain_client_max_body_bytes:
        raise ConfigError(
            f"must be 0 or at least --plain-client-max-body-bytes ({options.plain_client_max_body_bytes}): "
            "a plain-client body is read whole",
            path="--proxy-max-buffered-body-bytes",
        )
    if options.metrics_prefix and not METRIC_PREFIX.fullmatch(options.metrics_prefix):
        # prometheus_client would escape it into another name than the one the dashboards query.
        raise ConfigError(
            f"not the start of a metric name ({METRIC_PREFIX.pattern}): {options.metrics_prefix!r}",
            path="--metrics-prefix",
        )
    if options.lb_config_path is not None and not options.lb_config_path.strip():
        # An unset shell variable (`--lb-config-path "$LB_CONFIG"`) must not mean "allow everything".
        raise ConfigError(
            "names no file: leave the flag out for the permissive default", path="--lb-config-path"
        )
    dial = (options.grpc_pylon_dial_addr or "").strip() or None
    if dial is not None:
        try:  # every Pylon dials it: a malformed one it retries for ever
            dial = dial_url(dial)
        except ValueError as exc:
            raise ConfigError(str(exc), path="--grpc-pylon-dial-addr") from None
    lb_config = load_lb_config(options.lb_config_path) if options.lb_config_path else LbConfig.permissive()
    urls = tuple(
        part.strip() for raw in options.remote_stargate_url or () for part in raw.split(",") if part.strip()
    )
    return StargateSettings(
        stargate_id=options.stargate_id,
        advertise_addr=options.advertise_addr,
        listen_addr=options.listen_addr,
        model_discovery_listen_addr=options.model_discovery_listen_addr,
        http_listen_addr=options.http_listen_addr,
        http_header_read_timeout_ms=options.http_header_read_timeout_ms,
        http_body_read_timeout_ms=options.http_body_read_timeout_ms,
        http_send_timeout_ms=options.http_send_timeout_ms,
        metrics_host=unbracket(options.metrics_host),
        metrics_port=options.metrics_port,
        metrics_prefix=options.metrics_prefix,
        shutdown_drain_timeout_ms=options.shutdown_drain_timeout_ms,
        lb_config=lb_config,
        retry=RetrySettings(
            max_connect_retries=options.proxy_max_connect_retries,
            max_request_retries=options.proxy_max_request_retries,
            require_pylon_retry_signal=options.proxy_require_pylon_retry_signal,
            max_held_requests=options.max_held_requests,
        ),
        proxy=ProxySettings(
            max_replay_body_bytes=options.proxy_max_replay_body_bytes,
            max_buffered_body_bytes=buffered,
            default_max_wait_ms=min(options.default_max_wait_ms, MAX_WAIT_CAP_MS) or None,
            retry_budget_header=budget_header or None,
        ),
        connect_timeout_ms=options.quic_connect_timeout_ms,
        request_timeout_ms=options.quic_request_timeout_ms,
        backend_connection_limit=options.proxy_max_connections_per_backend,
        stargate_discovery_dns_name=options.stargate_discovery_dns_name,
        disable_dns_discovery=options.disable_dns_discovery,
        discovery=discovery_settings(options),
        otel_endpoint=options.otel_endpoint,
        otel_service_name=options.otel_service_name,
        grpc_pylon_dial_addr=dial,
        remote_stargate_urls=urls,
        watch_heartbeat_ms=options.watch_heartbeat_ms,
        registration_idle_timeout_ms=options.registration_update_idle_timeout_ms,
        registration_max_idle_timeout_ms=options.registration_update_max_idle_timeout_ms,
        tunnel_protocol=protocol,
        direct_quic_connections=options.direct_quic_connections,
        plain_clients=PlainClientSettings(
            max_body_bytes=options.plain_client_max_body_bytes,
            bytes_per_token=options.plain_client_bytes_per_token,
            session_header=session_header or None,
            tokenizer_path=options.plain_client_tokenizer,
            prefix_keys=options.plain_client_prefix_keys,
        )
        if options.plain_clients
        else None,
    )


def run(options: argparse.Namespace) -> int:
    """Run the router from parsed flags until a termination signal; returns the exit status."""
    runner.configure_logging(logging.INFO)
    try:
        settings = settings_from_args(options)
    except ConfigError as exc:
        print(f"stargate: {exc.describe()}", file=sys.stderr)
        return EXIT_USAGE
    return runner.run(serve(settings))


async def serve(settings: StargateSettings, stop: asyncio.Event | None = None) -> int:
    """Run until ``stop`` is set or a termination signal arrives; returns the exit status."""
    server = StargateServer(settings)
    try:
        addresses = await server.start()
    except ConfigError as exc:
        print(f"stargate: {exc.describe()}", file=sys.stderr)
        return EXIT_USAGE
    print(addresses.ready_line(), flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal() -> None:
        if stop.is_set():
            print("stargate: second signal, exiting immediately", file=sys.stderr, flush=True)
            os._exit(EXIT_FAILURE)
        log.info("draining: /readyz now answers 503")
        server.begin_drain()
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    runner.ignore_hangup(loop, log)
    try:
        await stop.wait()
        drained = await server.shutdown()
    finally:
        for sig in (*signals, signal.SIGHUP):
            loop.remove_signal_handler(sig)
    return EXIT_OK if drained else EXIT_FAILURE

