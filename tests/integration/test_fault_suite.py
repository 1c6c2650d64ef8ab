"""The fault suite's short version: real Stargate, Pylon and mock-engine processes, faults mid-load.

Every wait is bounded (fleet start and readiness, the client timeout, an overall deadline per test)
and the fleet is stopped on the way out, whatever happened.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from stargate.bench import plan
from stargate.bench.faults import ARRIVAL_FILE, read_arrivals
from stargate.bench.fleet import FleetTimeouts
from stargate.bench.procs import live_process_groups
from stargate.bench.runner import RunOutcome, run_suite
from stargate.bench.schema import parse_scenario
from stargate.bench.workload import build_workload

_CLIS = ("stargate.router.cli", "stargate.pylon.cli", "stargate.mock_engine.cli")
_missing = [name for name in _CLIS if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"component CLIs not importable yet: {_missing}")

DEADLINE_S = 120.0
TIMEOUTS = FleetTimeouts(start_s=30.0, ready_s=30.0, stop_grace_s=3.0)
PROFILE = {
    "max_concurrent_requests": 16,
    "service_time_ms": {"ttft_mean": 20, "decode_tokens_per_s": 200, "prefill_tokens_per_s": 200000},
    "registration": {"last_mean_input_tps": 1000},
}


def scenario_with(actions: list[dict[str, Any]], requests: int, tmp_path: Path) -> Any:
    data = {
        "name": "fault ci",
        "model": "dummy-model",
        "seed": 3,
        "request_count": requests,
        "max_concurrency": 32,
        "backends": {"count": 2, "profile": PROFILE},
        "traffic_pattern": {
            "kind": "uniform",
            "input_tokens": {"distribution": "constant", "value": 32},
            "output_tokens": {"distribution": "constant", "value": 8},
            "arrival": {"distribution": "constant", "interval_ms": 25},
        },
        "client": {"timeout_s": 15},
        "degradation": {"actions": actions},
        "algorithms": [{"name": "round-robin", "config": {"default": "round-robin"}}],
    }
    return parse_scenario(data, file="fault-ci.yaml", base_dir=tmp_path)


async def run_one(scenario: Any, out: Path) -> RunOutcome:
    async with asyncio.timeout(DEADLINE_S):
        result = await run_suite(scenario, build_workload(scenario), out, runs=plan.runs(scenario),
                                 timeouts=TIMEOUTS)
    (outcome,) = result.outcomes
    assert outcome.error is None, outcome.error
    assert not live_process_groups()
    return outcome


async def test_engine_kill_mid_load_loses_nothing_that_had_not_reached_an_engine(tmp_path: Path) -> None:
    scenario = scenario_with([{"at_request": 40, "backend_index": 0, "action": "kill_engine"}], 120, tmp_path)
    outcome = await run_one(scenario, tmp_path / "out")

    faults = outcome.faults
    assert faults is not None and faults.sent == 120
    (action,) = faults.actions
    assert action.error is None and action.at_s is not None and action.backends == ["backend-0"]
    before_kill = [r for r in outcome.records if r.ok and r.backend_id == "backend-0"]
    assert before_kill, "the killed engine served nothing: the fault hit an idle backend"
    assert faults.failed_before_engine == 0, faults.failed_before_engine_ids


async def test_pylon_freeze_and_backend_delete_fire_and_the_fleet_recovers(tmp_path: Path) -> None:
    actions = [
        {"at_request": 20, "backend_index": 1, "action": "freeze_pylon", "resume_after_ms": 300},
        {"at_request": 40, "backend_index": 0, "action": "delete_backend_pod"},
    ]
    out = tmp_path / "out"
    outcome = await run_one(scenario_with(actions, 80, tmp_path), out)

    faults = outcome.faults
    assert faults is not None
    freeze, delete = faults.actions
    assert freeze.error is None and delete.error is None  # the replay waited for the restart to finish
    assert freeze.at_s is not None and freeze.resumed_s is not None
    assert 0.25 <= freeze.resumed_s - freeze.at_s < 5.0
    logs = out / "run-round-robin" / "logs"
    assert (logs / "engine-engine-0.restart1.stdout.log").is_file()
    assert (logs / "pylon-backend-0.restart1.stdout.log").is_file()
    assert delete.left_routing and delete.routable_s is not None  # its registration broke at the kill
    served = {r.request_id for r in outcome.records if r.ok}
    assert served <= read_arrivals(out / "run-round-robin" / ARRIVAL_FILE)
    assert "## Faults" in (out / "report.md").read_text()
