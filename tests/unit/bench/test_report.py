from __future__ import annotations

from pathlib import Path

import orjson

from stargate.bench.charts import in_flight_series
from stargate.bench.report import machine_info, render_markdown, write_report
from stargate.bench.schema import load_scenario
from stargate.bench.score import RequestRecord, summarize

ROOT = Path(__file__).resolve().parents[3]


def records(run: str, backends: list[str], hit_every: int) -> list[RequestRecord]:
    out = []
    for i, backend in enumerate(backends):
        start = i * 0.05
        out.append(RequestRecord(
            index=i, request_id=f"{run}-{i}", run=run, scheduled_s=start, dispatch_s=start,
            headers_s=start + 0.01,
            first_token_s=start + 0.02 + 0.001 * i, last_token_s=start + 0.1, status=200, error_class=None,
            backend_id=backend, cluster_id=None, engine_id=None, cache_hit=i % hit_every == 0,
            cache_hit_tokens=50 if i % hit_every == 0 else 0, input_tokens=100, output_tokens=4, chunks=4,
            retries_seen=0, end_s=start + 0.1, cache_affinity_key=f"k{i % 3}",
        ))  # fmt: skip
    return out


def test_write_report_produces_markdown_json_and_charts(tmp_path: Path) -> None:
    scenario = load_scenario(ROOT / "benches" / "smoke.yaml")
    by_run = {
        "power-of-n": records("power-of-n", ["backend-0", "backend-1"] * 20, 2),
        "round-robin": records("round-robin", ["backend-0"] * 39 + [None], 3),  # type: ignore[list-item]
    }
    by_run["round-robin"][-1].status, by_run["round-robin"][-1].error_class = 503, "http_503"
    summaries = [summarize(run, recs, scenario, 2.0, 50.0) for run, recs in by_run.items()]
    report = write_report(tmp_path / "out", scenario, summaries, by_run)
    out = tmp_path / "out"
    for name in ("report.md", "comparison.json", "ttft-cdf.png", "backend-load.png", "cache-goodput.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft-cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.read_text()
    assert text.startswith("# Benchmark Report: smoke")
    assert "| power-of-n | 100.0% |" in text
    assert "| round-robin | 97.5% |" in text
    assert "## Failures" in text and "http_503" in text
    assert "round-robin: success rate 97.5% is below 100%" in text
    assert "![ttft-cdf](ttft-cdf.png)" in text
    assert "python" in text and "cpu model" in text
    rows = orjson.loads((out / "comparison.json").read_bytes())
    assert [r["run"] for r in rows] == ["power-of-n", "round-robin"]
    assert rows[0]["equal_balance"] == 1.0 and rows[1]["equal_balance"] == 0.5
    assert rows[0]["pylon_queue_admission"] is None


def test_the_header_counts_the_requests_sent_not_only_those_planned() -> None:
    """With ``execution.duration_s`` a run sends fewer than ``request_count`` (smoke plans 40)."""
    scenario = load_scenario(ROOT / "benches" / "smoke.yaml")
    short = summarize("a", records("a", ["backend-0"] * 30, 2), scenario, 2.0, None)
    shorter = summarize("b", records("b", ["backend-0"] * 28, 2), scenario, 2.0, None)
    assert "- Requests: 30 sent of 40 planned\n" in render_markdown(scenario, [short], [])
    assert "- Requests: 28-30 per run sent of 40 planned\n" in render_markdown(scenario, [short, shorter], [])
    whole = summarize("c", records("c", ["backend-0"] * 40, 2), scenario, 2.0, None)
    assert "- Requests: 40\n" in render_markdown(scenario, [whole], [])


def test_markdown_without_runs_warns() -> None:
    scenario = load_scenario(ROOT / "benches" / "smoke.yaml")
    assert "- no summaries found" in render_markdown(scenario, [], [])


def test_machine_info_reads_the_host() -> None:
    info = machine_info()
    assert info["cpu_count"].isdigit() and info["python"].count(".") == 2


def test_in_flight_series_counts_overlaps() -> None:
    recs = records("r", ["backend-0", "backend-0", "backend-1"], 1)
    grid, series = in_flight_series(recs, points=21)
    assert grid[0] == 0.0 and grid[-1] == recs[-1].end_s
    assert max(series["backend-0"]) == 2 and max(series["backend-1"]) == 1


def test_report_adds_medians_only_when_runs_repeat() -> None:
    scenario = load_scenario(ROOT / "benches" / "smoke.yaml")
    once = [summarize("power-of-n", records("power-of-n", ["backend-0"] * 5, 2), scenario, 1.0, None)]
    assert "## Across repeats" not in render_markdown(scenario, once, [])
    twice = [summarize(f"power-of-n #{n}", records(f"p{n}", ["backend-0"] * 5, 2), scenario, 1.0, None)
             for n in (1, 2)]  # fmt: skip
    text = render_markdown(scenario, twice, [])
    assert "## Across repeats" in text and "| power-of-n | 2 | 100.0% |" in text
