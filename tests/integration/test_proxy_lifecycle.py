"""The `stargate` command: flags, config errors (exit 2), the ready line and SIGTERM drain (124)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from stargate.cli import main
from stargate.router.cli import build_parser, settings_from_args

BASE_ARGS = [
    "--stargate-id",
    "s1",
    "--listen-addr",
    "127.0.0.1:0",
    "--model-discovery-listen-addr",
    "127.0.0.1:0",
    "--http-listen-addr",
    "127.0.0.1:0",
    "--metrics-port",
    "0",
    "--metrics-host",
    "127.0.0.1",
    "--advertise-addr",
    "127.0.0.1:0",
]
READY = re.compile(r"^stargate ready grpc=(\S+) discovery=(\S+) http=(\S+) metrics=(\S+)$")


def test_dns_name_required_unless_discovery_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BASE_ARGS) == 2
    assert "--stargate-discovery-dns-name" in capsys.readouterr().err


def test_bad_lb_config_exits_2_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "lb.json"
    path.write_text('{"default": "not-a-real-lb"}')
    assert main([*BASE_ARGS, "--disable-dns-discovery", "--lb-config-path", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not-a-real-lb" in err


def test_invalid_retry_budget_header_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE_ARGS, "--disable-dns-discovery", "--proxy-retry-budget-header", "bad header"]) == 2
    assert "invalid proxy retry budget header: bad header" in capsys.readouterr().err


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--stargate-id", "s1"]) == 2
    assert "--advertise-addr" in capsys.readouterr().err


def test_a_metrics_host_it_cannot_listen_on_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*BASE_ARGS, "--disable-dns-discovery"]
    args[args.index("--metrics-host") + 1] = "256.1.1.1"
    assert main(args) == 2
    assert "--metrics-host/--metrics-port: cannot listen on 256.1.1.1:0" in capsys.readouterr().err


@pytest.mark.parametrize("dial", ["::1:50071", "[::1]:99999", "host:0", "host", "quic://host:1"])
def test_a_pylon_dial_address_pylons_cannot_dial_is_refused(
    dial: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every Pylon was handed it and retried 'Misformatted domain name' for ever."""
    assert main([*BASE_ARGS, "--disable-dns-discovery", "--grpc-pylon-dial-addr", dial]) == 2
    assert "--grpc-pylon-dial-addr" in capsys.readouterr().err


def test_a_pylon_dial_address_keeps_its_form_with_its_scheme_lower_cased() -> None:
    def dial(value: str) -> str | None:
        options = build_parser({}).parse_args(
            [*BASE_ARGS, "--disable-dns-discovery", "--grpc-pylon-dial-addr", value]
        )
        return settings_from_args(options).grpc_pylon_dial_addr

    assert dial(" [::1]:50071 ") == "[::1]:50071"
    assert dial("HTTPS://sg.example:443") == "https://sg.example:443"
    assert dial("") is None


def test_a_bracketed_ipv6_metrics_host_is_that_address() -> None:
    """It was looked up as the name ``[::1]`` and reported as ``cannot listen on [[::1]]:0``."""
    args = [*BASE_ARGS, "--disable-dns-discovery"]
    args[args.index("--metrics-host") + 1] = "[::1]"
    assert settings_from_args(build_parser({}).parse_args(args)).metrics_host == "::1"


@pytest.mark.parametrize("prefix", ["bad-prefix_", "9x_"])
def test_a_metrics_prefix_that_cannot_start_a_name_is_refused(
    prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """prometheus_client escaped it (``bad_prefix_``, ``_x_``): the dashboards' queries found nothing."""
    assert main([*BASE_ARGS, "--disable-dns-discovery", "--metrics-prefix", prefix]) == 2
    assert "--metrics-prefix" in capsys.readouterr().err


def test_env_vars_and_flag_values_reach_settings() -> None:
    env = {
        "STARGATE_PROXY_MAX_CONNECT_RETRIES": "5",
        "STARGATE_PROXY_REQUIRE_PYLON_RETRY_SIGNAL": "false",
        "STARGATE_PROXY_RETRY_BUDGET_HEADER": "",
        "STARGATE_REMOTE_WATCH_URLS": "a:1, b:2",
    }
    options = build_parser(env).parse_args(
        [
            *BASE_ARGS,
            "--disable-dns-discovery",
            "--proxy-max-request-retries",
            "7",
            "--quic-connect-timeout-ms",
            "150",
        ]
    )
    settings = settings_from_args(options)
    assert settings.retry.max_connect_retries == 5 and settings.retry.max_request_retries == 7
    assert settings.retry.require_pylon_retry_signal is False
    assert settings.proxy.retry_budget_header is None
    assert settings.remote_stargate_urls == ("a:1", "b:2")
    assert settings.connect_timeout_ms == 150
    explicit = build_parser({}).parse_args(
        [*BASE_ARGS, "--disable-dns-discovery", "--proxy-require-pylon-retry-signal=true"]
    )
    assert settings_from_args(explicit).retry.require_pylon_retry_signal is True


async def test_p124_cli_prints_ready_line_and_drains_on_sigterm() -> None:
    code = "import sys; from stargate.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        *BASE_ARGS,
        "--disable-dns-discovery",
        "--shutdown-drain-timeout-ms",
        "2000",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ},
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        match = READY.match(line)
        assert match, line
        http, metrics = match.group(3), match.group(4)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"http://{http}/readyz") as resp:
                assert resp.status == 200
            async with session.get(f"http://{metrics}/metrics") as resp:
                assert resp.status == 200 and b"stargate_tls_reloads_total" in await resp.read()
            proc.send_signal(signal.SIGHUP)  # logged and ignored: it used to kill the router undrained
            assert proc.stderr is not None
            logged = await asyncio.wait_for(proc.stderr.readline(), 10)
            while b"SIGHUP ignored" not in logged:
                logged = await asyncio.wait_for(proc.stderr.readline(), 10)
            async with session.get(f"http://{http}/readyz") as resp:
                assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
