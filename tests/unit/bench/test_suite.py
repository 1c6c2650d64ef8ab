from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from stargate.bench.cli import main
from stargate.bench.suite import across_repeats, router_of, standing


def row(run: str, p99: float | None, goodput: float | None, success: float = 1.0) -> dict[str, Any]:
    return {"run": run, "p99_ttft_ms": p99, "goodput_rps": goodput, "success_rate": success,
            "p50_ttft_ms": p99 and p99 / 2, "requests_per_second": 9.0, "cache_hit_rate": 0.25,
            "inflight_imbalance": 1.25, "inflight_imbalance_p99": 2.0,
            "prefill_inflight_imbalance": 1.5}  # fmt: skip


def test_router_of_strips_only_the_repeat_suffix() -> None:
    assert router_of("stargate:power-of-n #2") == "stargate:power-of-n"
    assert router_of("direct") == "direct"
    assert router_of("odd #name") == "odd #name"


def test_across_repeats_takes_medians_and_the_worst_success() -> None:
    rows = [row("a #1", 300, 8.0), row("b #1", 500, 7.0), row("b #2", 700, 6.0, 0.9), row("a #2", 100, 9.0),
            row("a #3", 200, None)]  # fmt: skip
    a, b = across_repeats(rows)
    assert (a.router, a.runs, a.p99_ttft_ms, a.p99_ttft_min_ms, a.p99_ttft_max_ms) == ("a", 3, 200, 100, 300)
    assert a.goodput_rps == 8.5  # the run without a value is left out, not counted as zero
    assert (b.router, b.runs, b.p99_ttft_ms, b.success_rate) == ("b", 2, 600, 0.9)


def test_standing_picks_stargates_best_by_p99_and_the_best_peer_per_measure() -> None:
    results = across_repeats([
        row("stargate:power-of-n", 400, 9.0), row("stargate:wait-and-widen", 300, 8.0),
        row("stargate:pulsar", 100, 9.5, success=0.95),  # lost requests rank last whatever the latency
        row("sglang:cache_aware", 350, 7.0), row("vllm:consistent_hash", 500, 8.8), row("direct", 50, 10.0),
    ])  # fmt: skip
    found = standing("s", results)
    assert found is not None
    assert found.stargate.router == "stargate:wait-and-widen"
    assert found.best_p99_peer is not None and found.best_p99_peer.router == "sglang:cache_aware"
    assert found.best_goodput_peer is not None and found.best_goodput_peer.router == "vllm:consistent_hash"
    assert found.direct is not None and found.direct.p99_ttft_ms == 50
    assert found.p99_ratio == pytest.approx(300 / 350)
    assert found.goodput_ratio == pytest.approx(8.0 / 8.8)
    assert standing("s", across_repeats([row("direct", 1, 1)])) is None


def test_the_best_peer_is_the_lowest_p99_and_the_highest_goodput_whatever_its_success() -> None:
    """Success first is the rule for Stargate's algorithms only; a peer that lost a request still leads."""
    results = across_repeats([
        row("stargate:power-of-n", 1000, 9.0),
        row("sglang:cache_aware", 500, 9.5, success=0.99), row("vllm:cache_aware", 2000, 8.0),
        row("vllm:round_robin", None, None, success=0.0),  # failed entirely: no candidate
    ])  # fmt: skip
    found = standing("s", results)
    assert found is not None
    assert found.best_p99_peer is not None and found.best_p99_peer.router == "sglang:cache_aware"
    assert found.best_goodput_peer is not None and found.best_goodput_peer.router == "sglang:cache_aware"
    assert found.p99_ratio == pytest.approx(2.0)


def test_summarize_says_when_no_peer_completed(tmp_path: Path) -> None:
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "comparison.json").write_bytes(orjson.dumps([
        row("stargate:power-of-n", 300, 9.0), row("sglang:cache_aware", None, None, success=0.0),
    ]))  # fmt: skip
    assert main(["summarize", str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "| s1 | power-of-n | 1 | 300 | 9.00 | none completed | - | none completed | - |" in text
    assert "(sglang:cache_aware)" not in text


def test_summarize_writes_one_table_across_scenarios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, p99 in (("alpha", 200), ("beta", 600)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "comparison.json").write_bytes(orjson.dumps([
            row("stargate:wait-and-widen #1", p99, 9.0), row("stargate:wait-and-widen #2", p99 + 20, 9.2),
            row("sglang:cache_aware #1", 400, 9.0), row("sglang:cache_aware #2", 420, 9.0),
        ]))  # fmt: skip
    assert main(["summarize", str(tmp_path)]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "| alpha | wait-and-widen | 2 | 210 | 9.10 | 410 (sglang:cache_aware) | 0.51 |" in text
    assert "| beta | wait-and-widen | 2 | 610 | 9.10 | 410 (sglang:cache_aware) | 1.49 |" in text
    assert "## beta" in text and "| sglang:cache_aware | 2 | 100.0% | 9.00 | 205 | 410 | 400 to 420 |" in text
    assert "| 25.0% | 1.25 | 1.25 (sglang:cache_aware) |" in text  # Stargate's and the peer's imbalance
    assert "| 9.00 | 25.0% | 1.25 | 2.00 | - | 1.50 |" in text
    assert "| - | - (sglang:cache_aware) | 1.50 | 1.50 (sglang:cache_aware) |" in text  # per slot, prefill
    assert "summary:" in capsys.readouterr().out


def test_summarize_names_an_empty_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["summarize", str(tmp_path)]) == 2
    assert f"error: dir: no <scenario>/comparison.json under {tmp_path}\n" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"garbage", b"null", b'{"runs": 5}', b'[{"run": "a"}]'])
def test_summarize_names_a_file_that_is_not_a_comparison(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s1").mkdir()
    (tmp_path / "s1" / "comparison.json").write_bytes(content)
    assert main(["summarize", str(tmp_path)]) == 2
    assert f"{tmp_path / 's1' / 'comparison.json'}: not a comparison.json" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["fuzz"], ["run", "--scenario", "smoke"], ["gen-trace"]])
def test_an_out_it_cannot_write_to_is_a_usage_error(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Named before any fleet starts (it was a traceback once the run had begun)."""
    taken = tmp_path / "a-file"
    taken.write_text("")
    out = taken / "trace.jsonl" if command == ["gen-trace"] else taken
    assert main([*command, "--out", str(out)]) == 2
    assert f"error: --out: cannot write to {taken}" in capsys.readouterr().out


def test_a_trace_written_to_a_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["gen-trace", "--out", str(tmp_path)]) == 2  # was IsADirectoryError, a traceback
    assert f"error: --out: {tmp_path} is a directory, not a file to write" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "1.5", str(2**64)])
@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_seed_that_is_not_a_u64_is_a_usage_error(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a scenario's ``seed: -3`` is."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--scenario", "smoke", "--seed", value])
    assert exit_.value.code == 2 and "--seed" in capsys.readouterr().err
