"""`stargate validate-config FILE`: a summary and exit 0, or `<file>: <json path>: <reason>` and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stargate.cli import main


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "lb-config.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_valid_file_prints_summary_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path,
        {
            "default": "random",
            "request_algorithms": {"power-of-n": {"algorithm": "power-of-n", "sample_count": 4}},
            "models": {
                "model-a": {
                    "algorithm": "wait-and-widen",
                    "cache_affinity_backend_selection_count": 2,
                    "cache_affinity_wait_ms": 200,
                    "cache_affinity_input_tokens_scale": 0.1,
                }
            },
        },
    )
    assert main(["validate-config", path]) == 0
    out = capsys.readouterr().out
    assert f"{path}: valid" in out
    assert "default: random" in out
    assert "power-of-n (comparator=ttft, sample_count=4)" in out
    assert '"model-a": wait-and-widen' in out
    assert "cache_affinity_wait_ms=200" in out and "cache_affinity_input_tokens_scale=0.1" in out


def test_invalid_field_reports_file_path_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, {"models": {"model-a": {"algorithm": "power-of-n", "sample_count": 65}}})
    assert main(["validate-config", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f'{path}: $.models["model-a"].sample_count: power-of-n sample_count must be between 1 and 64, got 65'
    )


def test_c04_unsupported_field_via_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"models": {"m": {"algorithm": "round-robin", "seed": "x"}}})
    assert main(["validate-config", path]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"{path}: $.models.m: round-robin config does not support field(s): seed"
    )


def test_missing_file_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "absent.json")
    assert main(["validate-config", path]) == 2
    assert capsys.readouterr().err.startswith(f"{path}: failed to read lb config file")


def test_invalid_json_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, '{"default": ')
    assert main(["validate-config", path]) == 2
    assert capsys.readouterr().err.startswith(f"{path}: failed to parse lb config file")


def test_lone_surrogate_escape_exits_2_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, r'{"models": {"llama": {"algorithm": "pulsar", "seed": "\udc00"}}}')
    assert main(["validate-config", path]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"{path}: $.models.llama.seed: string is not valid Unicode: "
        "it holds the lone surrogate escape \\udc00"
    )


def test_usage_errors_exit_2_and_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-config"]) == 2
    assert "FILE" in capsys.readouterr().err
    assert main(["validate-config", "--help"]) == 0
    assert "usage: stargate validate-config" in capsys.readouterr().out


def test_without_a_command_the_flags_run_the_router(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--stargate-id", "s1"]) == 2
    assert "--advertise-addr: required to run the router" in capsys.readouterr().err


def test_help_lists_the_command_and_every_router_flag_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "validate-config" in text
    assert (
        "--proxy-max-connect-retries PROXY_MAX_CONNECT_RETRIES retries after a backend connect failure "
        "(default: 2) (env STARGATE_PROXY_MAX_CONNECT_RETRIES)" in text
    )
    assert "(default: True)" not in text and "(default: False)" not in text


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "lb-config").glob("*.json"))


def test_examples_directory_is_not_empty() -> None:
    assert EXAMPLES, "examples/lb-config/*.json is referenced by the README and docs"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_lb_configs_are_valid(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-config", str(path)]) == 0
    assert f"{path}: valid" in capsys.readouterr().out
