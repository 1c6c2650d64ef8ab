"""The ``stargate-mock-engine`` command line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from stargate.mock_engine.cli import LISTEN_LINE, build_parser, config_from_args, main, parse_listen_addr


def test_s9_1_unparsable_listen_address_exits_non_zero() -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--http-listen-addr", "not-a-socket-addr"])
    assert exited.value.code == 2


def test_s9_2_defaults() -> None:
    config, host, port = config_from_args(build_parser(), [])
    assert (host, port) == ("127.0.0.1", 8090)
    assert config.model == "dummy-model"
    timing = config.timing
    assert (timing.num_tokens, timing.token_delay_ms, timing.ttft_ms, timing.prefill_tokens_per_s) == (
        10,
        100,
        0,
        0,
    )
    assert (timing.decode_jitter_ms, timing.ttft_jitter_ms) == (0, 0)
    assert config.max_concurrent_requests == 0 and config.kv_cache_capacity_tokens == 0
    assert config.max_model_len == 1_000_000


def test_aliases_and_decode_rate() -> None:
    config, host, port = config_from_args(
        build_parser(),
        ["--port", "8001", "--model", "llama", "--host", "0.0.0.0", "--decode-tokens-per-s", "260"],
    )
    assert (host, port, config.model) == ("0.0.0.0", 8001, "llama")
    assert config.timing.token_delay_ms == pytest.approx(1000 / 260)


def test_listen_address_forms() -> None:
    assert parse_listen_addr("[::1]:0") == ("::1", 0)
    for bad in ("localhost:80", "1.2.3.4", "1.2.3.4:99999"):
        with pytest.raises(ValueError):
            parse_listen_addr(bad)


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--kv-block-size", "0"])
    assert exited.value.code == 2 and "--kv-block-size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--token-delay-ms", "NaN"], "--token-delay-ms"),
        (["--decode-slowdown", "inf"], "--decode-slowdown"),
        (["--prefill-tokens-per-s", "-5"], "--prefill-tokens-per-s"),
        (["--port", "70000"], "--port"),
        (["--request-log", "/nonexistent-dir/requests.jsonl"], "--request-log"),
        (["--arrival-log", "/"], "--arrival-log"),
        (["--max-model-len", "0"], "--max-model-len"),
    ],
)
def test_values_the_engine_cannot_run_with_are_usage_errors(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A NaN delay started and then failed every stream; a log it cannot open was blamed on the
    listen address."""
    with pytest.raises(SystemExit) as exited:
        config_from_args(build_parser(), args)
    assert exited.value.code == 2 and named in capsys.readouterr().err


def test_process_prints_address_serves_and_stops_on_sigterm() -> None:
    command = [sys.executable, "-m", "stargate.mock_engine.cli", "--port", "0", "--model", "llama"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(LISTEN_LINE + "http://127.0.0.1:")
        url = line[len(LISTEN_LINE) :].strip()
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            assert response.read() == b"ok"
        process.send_signal(signal.SIGHUP)  # logged and ignored: it used to kill the process
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            assert response.read() == b"ok"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def test_an_address_in_use_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["--port", str(taken.getsockname()[1])]) == 2
    error = capsys.readouterr().err
    assert "--http-listen-addr/--host/--port: cannot listen on 127.0.0.1:" in error
