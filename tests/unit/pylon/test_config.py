from __future__ import annotations

import argparse
import base64
import math
import re
from pathlib import Path

import pytest

from stargate.errors import ConfigError
from stargate.pylon.admission import threshold_ms
from stargate.pylon.cli import main
from stargate.pylon.config import (
    StatsStreamMode,
    UpstreamBackend,
    build_parser,
    health_candidates,
    parse_settings,
)

BASE = ["--upstream-http-base-url", "http://127.0.0.1:8090/"]


def parse(*extra: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return parse_settings([*BASE, *extra], env)


def test_b01_defaults() -> None:
    s = parse()
    assert (s.inference_server_id, s.cluster_id) == ("pylon", "pylon")
    assert (
        s.discovery_mode and s.discovery_poll_interval_ms == 5000 and s.discovery_request_timeout_ms == 5000
    )
    assert s.stats_stream_mode is StatsStreamMode.AUTO
    assert s.stats_stream_url == "http://127.0.0.1:8090/pylon/v1/stats/stream"
    assert s.min_update_interval_ms == 1000
    assert s.upstream_base_url == "http://127.0.0.1:8090"
    assert s.max_engine_concurrency is None


def test_credentials_in_the_engine_url_are_kept_apart_from_it() -> None:
    s = parse_settings(["--upstream-http-base-url", "https://ad%40min:pa%3Ass@engine:8443/v1/"])
    assert s.upstream_base_url == "https://engine:8443/v1"  # what every log line shows
    assert s.stats_stream_url == "https://engine:8443/v1/pylon/v1/stats/stream"
    assert s.upstream_authorization == "Basic " + base64.b64encode(b"ad@min:pa:ss").decode()
    assert parse().upstream_authorization is None


@pytest.mark.parametrize(
    "url",
    [
        "http://::1:8090",
        "http://[::1:8090",
        "http://[::1]:99999",
        "http://[::1]:abc",
        "http://[::1]:0",
        "http://127.0.0.1:8090?x=1",
        "http://127.0.0.1:8090/v1#top",
        "http://:8090",
    ],
)
def test_an_engine_url_aiohttp_cannot_send_to_is_a_usage_error(url: str) -> None:
    """Each made every request and health probe a 500 with a traceback, or put its query mid-path."""
    with pytest.raises(ConfigError, match="--upstream-http-base-url"):
        parse_settings(["--upstream-http-base-url", url])


def test_an_engine_url_may_name_a_path_prefix_and_its_scheme_in_any_case() -> None:
    assert parse_settings(["--upstream-http-base-url", "HTTP://[::1]:8090/engine/"]).upstream_base_url == (
        "http://[::1]:8090/engine"
    )
    assert (
        parse_settings(["--upstream-http-base-url", "https://engine"]).upstream_base_url == "https://engine"
    )
    assert parse("--stargate-address", "HTTPS://sg:443").stargate_addresses == ("https://sg:443",)


def test_a_refused_engine_url_is_shown_without_its_password() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_settings(["--upstream-http-base-url", "http://admin:s3cret@[::1]:99999"])
    assert "s3cret" not in str(raised.value) and "http://[::1]:99999" in str(raised.value)
    with pytest.raises(ConfigError) as raised:  # an unencoded / in the password reads as a path
        parse_settings(["--upstream-http-base-url", "http://user:pa/ssSECRET@127.0.0.1:99999"])
    assert "SECRET" not in str(raised.value) and "127.0.0.1:99999" in str(raised.value)


def test_a_bracketed_ipv6_metrics_host_is_that_address() -> None:
    assert parse("--metrics-host", "[::1]").metrics_host == "::1"
    with pytest.raises(ConfigError, match="--metrics-host"):
        parse("--metrics-host", "[localhost]")


def test_b02_unknown_discovery_provider() -> None:
    with pytest.raises(ConfigError, match="--model-discovery-provider"):
        parse("--model-discovery-provider", "unknown")


def test_b03_static_models_sorted_dedup() -> None:
    assert parse("--model-name", "b", "--model-name", "a", "--model-name", "b").model_names == ("a", "b")


def test_b04_blank_model_name() -> None:
    with pytest.raises(ConfigError, match="--model-name"):
        parse("--model-name", "   ")
    for name in ("mod\u00e8le", "a\nb", "m" * 513):  # Stargate refuses a registration listing it
        with pytest.raises(ConfigError, match="--model-name"):
            parse("--model-name", name)
    assert parse("--model-name", " llama ").model_names == ("llama",)


@pytest.mark.parametrize(
    "flag", ["--model-discovery-poll-interval-ms", "--model-discovery-request-timeout-ms"]
)
def test_b05_zero_discovery_intervals(flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse(flag, "0")


def test_b06_calibration_and_initial_tps_exclusive() -> None:
    with pytest.raises(ConfigError, match="--do-calibration/--initial-input-tps"):
        parse("--do-calibration", "--initial-input-tps", "2200")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_b07_invalid_initial_tps(value: str) -> None:
    with pytest.raises(ConfigError, match="--initial-input-tps"):
        parse(f"--initial-input-tps={value}")


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--http-advertise-addr", "bad"),  # registered as http://bad: never routable
        ("--http-advertise-addr", "pylon-0:0"),
        ("--http-advertise-addr", "10.0.0.1:8001:8001"),  # a name no resolver answers
        ("--inference-server-id", " "),  # every registration refused, for ever
        ("--canary-max-generation-threshold", "0"),  # every canary a runaway: INACTIVE for ever
        ("--calibration-prompt-units", "255"),
        ("--calibration-max-concurrency", "0"),
        ("--pylon-retryable-upstream-status-codes", "999"),
    ],
)
def test_values_that_can_never_work_are_refused_at_start(flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        parse(flag, value)


def test_an_advertised_address_may_be_a_name() -> None:
    assert parse("--http-advertise-addr", "pylon-0.pylons:9001").http_advertise_addr == "pylon-0.pylons:9001"


def test_b08_pin_requires_initial_tps() -> None:
    with pytest.raises(ConfigError, match="--benchmark-pin-input-tps"):
        parse("--benchmark-pin-input-tps")


def test_buffered_body_room_holds_one_body_or_is_off() -> None:
    assert parse().max_buffered_body_bytes == 1 << 30
    assert parse("--max-buffered-body-bytes", "0").max_buffered_body_bytes == 0
    with pytest.raises(ConfigError, match="--max-buffered-body-bytes"):
        parse("--max-buffered-body-bytes", str((64 << 20) - 1))


def test_b09_calibration_requests_zero() -> None:
    with pytest.raises(ConfigError, match="--calibration-requests"):
        parse("--do-calibration", "--calibration-requests", "0")


def test_b10_tolerance_factor_zero() -> None:
    with pytest.raises(ConfigError, match="--pylon-queue-mismatch-tolerance-factor"):
        parse("--pylon-queue-mismatch-tolerance-factor", "0")


def test_b11_retryable_status_codes() -> None:
    assert parse("--pylon-retryable-upstream-status-codes", "418, 429,503").retryable_statuses == {
        418,
        429,
        503,
    }
    assert parse("--pylon-retryable-upstream-status-codes=").retryable_statuses == frozenset()
    assert parse(env={"PYLON_RETRYABLE_UPSTREAM_STATUS_CODES": "500"}).retryable_statuses == {500}
    with pytest.raises(ConfigError, match="--pylon-retryable-upstream-status-codes"):
        parse("--pylon-retryable-upstream-status-codes", "429,nope")


def test_b12_upstream_backend() -> None:
    with pytest.raises(ConfigError, match="--pylon-upstream-backend"):
        parse("--pylon-upstream-backend", "sglang")
    assert parse("--pylon-upstream-backend", " Passthrough ").upstream_backend is UpstreamBackend.PASSTHROUGH
    assert parse("--pylon-upstream-backend", "dynamo").upstream_backend is UpstreamBackend.DYNAMO


def test_b13_kv_url_join() -> None:
    assert parse("--kv-cache-stats-path", "kv/live").kv_cache_stats_url == "http://127.0.0.1:8090/kv/live"


def test_b14_fallback_at_start() -> None:
    assert parse("--engine-stats-stream", "off").fallback_stats_at_start
    assert not parse("--engine-stats-stream", "auto").fallback_stats_at_start
    assert not parse("--engine-stats-stream", "required").fallback_stats_at_start
    assert parse("--engine-stats-source", "prometheus").fallback_stats_at_start


def test_b15_auth_token_sources(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stargate.pylon.registration import token_source

    f = tmp_path / "token"
    f.write_text("  abc \n")
    s = parse("--auth-token-file", str(f))
    read = token_source(s.auth_token, s.auth_token_file)
    assert read() == "abc"
    f.write_text("def")
    assert read() == "def"
    assert token_source("static", str(f))() == "static"
    assert parse(env={"STARGATE_AUTH_TOKEN": "env-token"}).auth_token == "env-token"
    # Trimmed as the file is: a secret made from a file ends with a newline.
    assert parse(env={"STARGATE_AUTH_TOKEN": "env-token\n"}).auth_token == "env-token"


@pytest.mark.parametrize("token", ["tök", "to ken", "tok\x01en"])
def test_a_token_that_cannot_travel_as_grpc_metadata_is_a_usage_error(tmp_path: Path, token: str) -> None:
    """Every registration stream failed (``Invalid metadata``) while Pylon said it was ready."""
    with pytest.raises(ConfigError) as raised:
        parse("--auth-token", token)
    assert "--auth-token" in str(raised.value) and token not in str(raised.value)
    f = tmp_path / "token"
    f.write_bytes(token.encode())
    with pytest.raises(ConfigError, match="no usable token") as raised:
        parse("--auth-token-file", str(f))
    assert raised.value.path == "--auth-token-file"
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="no usable token"):
        parse("--auth-token-file", str(f))


def test_a_token_file_rotated_to_an_unusable_token_registers_without_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from stargate.pylon.registration import token_source

    f = tmp_path / "token"
    f.write_text("abc")
    read = token_source(None, str(f))
    f.write_bytes(b"\xffabc")
    assert read() is None
    assert any("no usable token" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    f.write_text("def\n")
    assert read() == "def"


def test_an_unreadable_token_file_is_a_usage_error_at_start_and_a_warning_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Registering without the token Stargate expects fails every stream: say why, at once."""
    from stargate.pylon.registration import token_source

    with pytest.raises(ConfigError) as raised:
        parse("--auth-token-file", str(tmp_path / "missing"))
    assert raised.value.path == "--auth-token-file" and "missing" in raised.value.message
    f = tmp_path / "token"
    f.write_text("abc")
    s = parse("--auth-token-file", str(f))
    f.unlink()  # the secret went away while Pylon ran
    assert token_source(s.auth_token, s.auth_token_file)() is None
    assert any("--auth-token-file" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_b24_health_candidates() -> None:
    assert health_candidates([]) == ("/health", "/v1/health/ready")
    assert health_candidates(["ping", " ", "/health"]) == ("/ping", "/health", "/v1/health/ready")


def test_b71_threshold() -> None:
    u64 = 2**64 - 1
    assert threshold_ms(100, 25, 1.25) == 125
    assert threshold_ms(0, 25, 1.25) == 25
    assert threshold_ms(u64, 25, 1.25) == u64
    assert threshold_ms(100, 0, math.nan) == 100


def test_max_engine_concurrency_must_be_positive() -> None:
    assert parse("--max-engine-concurrency", "25").max_engine_concurrency == 25
    with pytest.raises(ConfigError, match="--max-engine-concurrency"):
        parse("--max-engine-concurrency", "0")


def test_stats_update_coalesce() -> None:
    assert parse().stats_update_coalesce_ms == 0  # the spec's heartbeats only
    assert parse("--stats-update-coalesce-ms", "10").stats_update_coalesce_ms == 10
    with pytest.raises(ConfigError, match="--stats-update-coalesce-ms"):
        parse("--stats-update-coalesce-ms", "-1")


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--do-calibration", "--initial-input-tps", "5"]) == 2
    assert "--do-calibration/--initial-input-tps" in capsys.readouterr().err
    assert main([]) == 2
    assert "--upstream-http-base-url" in capsys.readouterr().err
    assert main([*BASE, "--http-listen-addr", "localhost:1"]) == 2


def test_help_describes_every_flag_with_its_default() -> None:
    parser = build_parser()
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            assert action.help and action.help.strip(), action.option_strings
    text = " ".join(parser.format_help().partition("options:")[2].split())  # unwrapped, no usage
    assert "--benchmark-pin-input-tps" not in text
    for flag, default in [
        ("--active-canary-interval-ms", "5000"),
        ("--canary-max-generation-threshold", "237"),
        ("--engine-stats-stream-path", "/pylon/v1/stats/stream"),
        ("--metrics-port", "9089"),
        ("--pylon-queue-mismatch-tolerance-factor", "1.25"),
    ]:
        at = text.index(f"{flag} {flag.removeprefix('--').replace('-', '_').upper()}")
        assert f"(default: {default})" in text[at : at + 250], flag
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: [])" not in text


def test_log_level_flag_and_its_variable() -> None:
    assert parse().log_level == "INFO"
    assert parse(env={"PYLON_LOG_LEVEL": "debug"}).log_level == "DEBUG"
    assert parse("--log-level", "warning", env={"PYLON_LOG_LEVEL": "debug"}).log_level == "WARNING"
    with pytest.raises(ConfigError, match="--log-level"):
        parse(env={"PYLON_LOG_LEVEL": "chatty"})


def test_stargate_address_is_repeatable_with_one_default() -> None:
    base = ["--upstream-http-base-url", "http://127.0.0.1:8000"]
    assert parse_settings(base).stargate_addresses == ("http://127.0.0.1:50071",)
    seeds = [*base, "--stargate-address", "a:1", "--stargate-address", "https://b:2"]
    seeds += ["--stargate-address", "a:1"]
    assert parse_settings(seeds).stargate_addresses == ("http://a:1", "https://b:2")
    assert parse("--stargate-address", " [::1]:7/ ").stargate_addresses == ("http://[::1]:7/",)


@pytest.mark.parametrize(
    "value",
    [
        "127.0.0.1:127976",
        "127.0.0.1:99999",
        "127.0.0.1:-5",
        "127.0.0.1:0",
        "127.0.0.1",
        "127.0.0.1:x",
        "127.0.0.1:127.0.0.1:63591",
        "1.2.3.4:5:6",
        "http://",
        "https://:80",
        ":80",
        " ",
        "dns:///127.0.0.1:5",
        "http://u@b:2",
        "http://b:2/x",
    ],
)
def test_a_stargate_address_grpc_cannot_dial_is_a_usage_error(value: str) -> None:
    """gRPC dials such a port modulo 65536 (another process's), or retries such a target for ever."""
    with pytest.raises(ConfigError, match=f"--stargate-address.*{re.escape(repr(value))}"):
        parse("--stargate-address", value)


@pytest.mark.parametrize("flag", ["--inference-server-id", "--cluster-id"])
def test_an_identity_every_stargate_refuses_is_a_usage_error(flag: str) -> None:
    """Stargate's own rule: it sets the identity as a header on every response it proxies."""
    for value in ("\u00e9", "a\nb", "x" * 513):
        with pytest.raises(ConfigError, match=flag):
            parse(flag, value)
    assert getattr(parse(flag, " pylon-0 "), flag.removeprefix("--").replace("-", "_")) == "pylon-0"
    assert getattr(parse(flag, "x" * 512), flag.removeprefix("--").replace("-", "_")) == "x" * 512


def test_a_blank_cluster_id_is_the_default_and_a_blank_server_id_an_error() -> None:
    """``--cluster-id "$CLUSTER"`` with the variable unset keeps the spec's default."""
    assert parse("--inference-server-id", "p1", "--cluster-id", " ").cluster_id == "p1"
    with pytest.raises(ConfigError, match="--inference-server-id"):
        parse("--inference-server-id", " ")
