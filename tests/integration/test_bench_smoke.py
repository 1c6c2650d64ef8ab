"""End to end: a tiny scenario through real stargate, pylon and mock-engine processes on loopback."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import orjson
import pytest

from stargate.bench import plan
from stargate.bench.fleet import FleetTimeouts
from stargate.bench.peers.compare import PeerOptions, resolve_routers, run_compare
from stargate.bench.procs import live_process_groups
from stargate.bench.runner import SilentProgress, run_suite
from stargate.bench.schema import parse_scenario
from stargate.bench.score import RequestRecord
from stargate.bench.workload import build_workload

_CLIS = ("stargate.router.cli", "stargate.pylon.cli", "stargate.mock_engine.cli")
_missing = [name for name in _CLIS if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"component CLIs not importable yet: {_missing}")

PROFILE = {
    "max_concurrent_requests": 4,
    "kv_cache_capacity_tokens": 100000,
    "service_time_ms": {"ttft_mean": 5, "decode_tokens_per_s": 500, "prefill_tokens_per_s": 200000},
    "registration": {"last_mean_input_tps": 1000},
}


def tiny_scenario(base: Path) -> dict[str, object]:
    return {
        "name": "bench smoke",
        "model": "dummy-model",
        "seed": 7,
        "request_count": 16,
        "max_concurrency": 4,
        "backends": {"count": 2, "profile": PROFILE},
        "traffic_pattern": {
            "kind": "uniform",
            "routing_keys": 0,
            "cache_affinity_keys": 4,
            "input_tokens": {"distribution": "uniform", "min": 32, "max": 64},
            "output_tokens": {"distribution": "constant", "value": 4},
            "arrival": {"distribution": "constant", "interval_ms": 10},
        },
        "client": {"timeout_s": 20},
        "algorithms": [
            {"name": "round-robin", "config": {"default": "round-robin"}},
        ],
    }


async def test_two_runs_end_to_end_one_failing_cleanly(tmp_path: Path) -> None:
    scenario = parse_scenario(tiny_scenario(tmp_path), file="smoke.yaml", base_dir=tmp_path)
    workload = build_workload(scenario)
    out = tmp_path / "out"
    # A run whose router cannot start: a scenario would refuse this config, so the run is made here.
    failing = plan.RunSpec("broken", {"default": "no-such-algorithm"}, [])
    result = await run_suite(scenario, workload, out, runs=[*plan.runs(scenario), failing],
                             timeouts=FleetTimeouts(start_s=30.0, ready_s=30.0, stop_grace_s=5.0))

    good, broken = result.outcomes
    assert good.error is None, good.error
    assert len(good.records) == 16
    assert all(r.ok for r in good.records), [r for r in good.records if not r.ok]
    assert {r.backend_id for r in good.records} == {"backend-0", "backend-1"}
    assert all(r.engine_id in ("engine-0", "engine-1") and r.chunks == 4 for r in good.records)
    assert any(r.cache_hit for r in good.records)  # 16 requests over 4 keys must reuse some

    assert broken.error is not None and broken.records == []
    assert "stargate-0" in broken.error or "lb" in broken.error.lower()

    run_dir = out / "run-round-robin"
    lines = (run_dir / "requests.jsonl").read_bytes().splitlines()
    assert RequestRecord.from_dict(orjson.loads(lines[0])).run == "round-robin"
    assert any(p.name.startswith("metrics-after-sg-0") for p in run_dir.iterdir())
    assert (run_dir / "logs" / "stargate-0.stdout.log").is_file()
    assert result.report_path.is_file() and (out / "run-metadata.json").is_file()
    assert [s.run for s in result.summaries] == ["round-robin", "broken"]
    assert result.summaries[0].success_rate == 1.0
    assert not live_process_groups()


async def test_a_client_that_does_not_stream_gets_json_answers_through_the_fleet(tmp_path: Path) -> None:
    data = tiny_scenario(tmp_path) | {"client": {"timeout_s": 20, "stream": False}, "request_count": 4}
    scenario = parse_scenario(data, file="smoke.yaml", base_dir=tmp_path)
    result = await run_suite(scenario, build_workload(scenario), tmp_path / "out", runs=plan.runs(scenario),
                             timeouts=FleetTimeouts(start_s=30.0, ready_s=30.0, stop_grace_s=5.0))
    (outcome,) = result.outcomes
    assert outcome.error is None, outcome.error
    assert [(r.status, r.ok, r.chunks) for r in outcome.records] == [(200, True, 4)] * 4


class _CancelAfter(SilentProgress):
    """Cancels ``task`` once ``count`` requests have finished, as Ctrl-C would."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.task: asyncio.Task[object] | None = None

    def request_done(self, name: str, record: RequestRecord) -> None:
        self.count -= 1
        if self.count == 0 and self.task is not None:
            self.task.cancel()


async def test_compare_writes_runs_json_and_an_interrupted_run_keeps_its_finished_requests(
    tmp_path: Path,
) -> None:
    data = tiny_scenario(tmp_path) | {"request_count": 4}
    scenario = parse_scenario(data, file="smoke.yaml", base_dir=tmp_path)
    choices = resolve_routers(scenario, "direct", PeerOptions(install=False))
    timeouts = FleetTimeouts(start_s=30.0, ready_s=30.0, stop_grace_s=5.0)
    await run_compare(scenario, build_workload(scenario), tmp_path / "done", choices, timeouts=timeouts)
    (run,) = orjson.loads((tmp_path / "done" / "runs.json").read_bytes())
    assert (run["name"], run["status"], run["requests"], run["run_dir"]) == ("direct", "ok", 4, "run-direct")

    slow = parse_scenario(data | {"request_count": 40}, file="smoke.yaml", base_dir=tmp_path)
    stopper = _CancelAfter(3)
    task = asyncio.create_task(run_compare(slow, build_workload(slow), tmp_path / "cut", choices,
                                           timeouts=timeouts, progress=stopper))  # fmt: skip
    stopper.task = task
    with pytest.raises(asyncio.CancelledError):
        await task
    lines = (tmp_path / "cut" / "run-direct" / "requests.jsonl").read_bytes().splitlines()
    assert 3 <= len(lines) < 40
    assert not live_process_groups()
