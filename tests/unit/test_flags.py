"""Flags declared once: an environment variable replaces a default, the command line wins, help says both."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stargate.bench.cli import build_parser as bench_parser
from stargate.cli import build_parser as stargate_parser
from stargate.errors import ConfigError
from stargate.flags import FlagSet, non_negative_int, parse_bool, positive_int
from stargate.mock_engine.cli import build_parser as engine_parser
from stargate.pylon.config import build_parser as pylon_parser
from stargate.pylon.config import parse_settings

BASE = ["--upstream-http-base-url", "http://127.0.0.1:8090"]


def flag_set(env: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add = FlagSet(parser, env).add
    add("--retries", env_var="T_RETRIES", type=non_negative_int, default=2, help="retries")
    add("--strict", env_var="T_STRICT", type=parse_bool, default=False, help="strict")
    return parser


def test_environment_replaces_the_default_and_the_command_line_wins() -> None:
    assert flag_set({}).parse_args([]).retries == 2
    assert flag_set({"T_RETRIES": "5", "T_STRICT": "yes"}).parse_args([]).retries == 5
    assert flag_set({"T_STRICT": "yes"}).parse_args([]).strict is True
    assert flag_set({"T_RETRIES": "5"}).parse_args(["--retries", "7"]).retries == 7


def test_a_bad_environment_value_is_checked_by_the_flags_type() -> None:
    with pytest.raises(argparse.ArgumentError, match="--retries"):
        flag_set({"T_RETRIES": "-1"}).parse_args([])


@pytest.mark.parametrize("raw", ["0", "-1", " -3 ", "x", ""])
def test_a_positive_flag_names_every_refused_value_alike(raw: str) -> None:
    """0 said "must be greater than 0" where -1 said "expected a non-negative integer"."""
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        positive_int(raw)
    assert str(refused.value) == f"expected a positive integer, got {raw!r}"
    assert positive_int(" 7 ") == 7


def test_help_shows_the_default_once_and_the_variable() -> None:
    text = " ".join(flag_set({}).format_help().split())
    assert "retries (default: 2) (env T_RETRIES)" in text
    assert "strict (default: false) (env T_STRICT)" in text


def test_help_never_shows_a_variables_value() -> None:
    """``pylon --help`` printed the bearer token taken from ``STARGATE_AUTH_TOKEN``."""
    text = " ".join(flag_set({"T_RETRIES": "7"}).format_help().split())
    assert "retries (default: 2) (env T_RETRIES)" in text and "7" not in text
    help_text = pylon_parser({"STARGATE_AUTH_TOKEN": "ENVSECRET123"}).format_help()
    assert "ENVSECRET123" not in help_text


@pytest.mark.parametrize("parser", [stargate_parser({}), pylon_parser()], ids=["stargate", "pylon"])
def test_every_flag_states_at_most_one_default(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        assert (action.help or "").count("(default:") <= 1, action.option_strings


def test_pylon_environment_values_are_typed_like_their_flags() -> None:
    settings = parse_settings(BASE, {"PYLON_PRIORITY_CEILING": "7", "PYLON_UPSTREAM_BACKEND": "Passthrough"})
    assert settings.priority_ceiling == 7 and settings.upstream_backend == "passthrough"
    assert parse_settings([*BASE, "--pylon-priority-ceiling", "9"], {"PYLON_PRIORITY_CEILING": "7"}) \
        .priority_ceiling == 9
    with pytest.raises(ConfigError, match="--pylon-queue-mismatch-min-delta-ms"):
        parse_settings(BASE, {"PYLON_QUEUE_MISMATCH_MIN_DELTA_MS": "soon"})


def test_bench_and_mock_engine_flags_go_through_the_flag_set() -> None:
    env = {"STARGATE_BENCH_PEERS_DIR": "/tmp/peers"}
    assert bench_parser(env).parse_args(["overhead"]).peers_dir == Path("/tmp/peers")
    assert bench_parser({}).parse_args(["compare", "--scenario", "x"]).peers_dir is None
    assert bench_parser({}).parse_args(["overhead"]).concurrency == (1, 32)
    engine = engine_parser({})
    assert engine.parse_args(["--model", "m"]).model == "m"
    assert "(default: dummy-model)" in engine.format_help()


def test_a_bad_environment_value_names_its_variable() -> None:
    with pytest.raises(argparse.ArgumentError, match=r"--retries.*-1.*environment variable T_RETRIES"):
        flag_set({"T_RETRIES": "-1"}).parse_args([])
    with pytest.raises(argparse.ArgumentError) as bad_flag:
        flag_set({"T_RETRIES": "5"}).parse_args(["--retries", "x"])
    assert "T_RETRIES" not in str(bad_flag.value)


@pytest.mark.parametrize("value", ["", "  "])
def test_an_lb_config_path_naming_no_file_is_a_usage_error_not_the_permissive_default(value: str) -> None:
    """``--lb-config-path "$LB_CONFIG"`` with the variable unset started a router that allowed everything."""
    from stargate.router.cli import build_parser, settings_from_args

    base = ["--stargate-id", "s", "--advertise-addr", "127.0.0.1:1", "--disable-dns-discovery"]
    with pytest.raises(ConfigError, match="--lb-config-path"):
        settings_from_args(build_parser({}).parse_args([*base, "--lb-config-path", value]))
