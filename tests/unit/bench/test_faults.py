"""Fault bookkeeping: the routing watch, the loss count and the action schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stargate.bench.console import resolve_scenario
from stargate.bench.fault_suite import goals_met, suite_run, summary_rows
from stargate.bench.faults import (
    ActionReport,
    FaultReport,
    failed_before_engine,
    markdown_section,
    read_arrivals,
    routable_ids,
    routable_time,
)
from stargate.bench.schema import DegradationAction, load_scenario
from stargate.bench.score import RequestRecord


def record(rid: str, status: int | None, error: str | None) -> RequestRecord:
    return RequestRecord(index=0, request_id=rid, run="r", scheduled_s=0.0, dispatch_s=0.0, headers_s=None,
                         first_token_s=None, last_token_s=None, status=status, error_class=error,
                         backend_id=None, cluster_id=None, engine_id=None, cache_hit=None,
                         cache_hit_tokens=None, input_tokens=1, output_tokens=1, chunks=0, retries_seen=0)


def routing(*backends: str, model: str = "m", **extra: Any) -> dict[str, Any]:
    members = [{"inference_server_id": b, **extra} for b in backends]
    return {"targets": [{"routing_key": None, "model_id": model, "clusters": [{"backends": members}]}]}


def test_routable_ids_reads_every_target_of_the_model_and_honours_a_routable_flag() -> None:
    payload = routing("backend-0", "backend-1")
    payload["targets"].append(routing("backend-9", model="other")["targets"][0])
    assert routable_ids(payload, "m") == {"backend-0", "backend-1"}
    assert routable_ids(routing("backend-0", routable=False), "m") == set()
    assert routable_ids({"unexpected": 1}, "m") == set()


def test_routable_time_waits_for_every_stargate() -> None:
    both, one = frozenset({"backend-0", "backend-1"}), frozenset({"backend-1"})
    samples = [(1.0, 0, both), (1.0, 1, both), (1.4, 0, one), (1.6, 1, both), (2.1, 1, one)]
    assert routable_time(samples, 2, ["backend-0"], 1.0, 5.0) == pytest.approx((1.1, True))


def test_routable_time_is_a_lower_bound_when_the_backend_never_left() -> None:
    samples = [(1.0, 0, frozenset({"backend-0"})), (8.0, 0, frozenset({"backend-0"})), (9.5, 0, frozenset())]
    assert routable_time(samples, 1, ["backend-0"], 1.0, 9.0) == (8.0, False)


def test_a_failure_counts_as_lost_only_if_no_engine_accepted_it_and_no_200_came() -> None:
    records = [record("ok", 200, None), record("cut", 200, "stream_cut"), record("refused", 503, "http_503"),
               record("ran", 503, "http_503"), record("timeout", None, "timeout")]
    assert failed_before_engine(records, {"ok", "cut", "ran"}) == ["refused", "timeout"]


def test_read_arrivals_skips_a_cut_line_and_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "arrivals.jsonl"
    path.write_bytes(b'{"request_id":"a","backend_id":"e0","arrival":1.0}\n{"request_id":"b","bac')
    assert read_arrivals(path) == {"a"}
    assert read_arrivals(tmp_path / "absent.jsonl") == set()


def test_resume_after_is_only_for_freezes() -> None:
    DegradationAction(at_request=1, backend_index=0, action="freeze_engine", resume_after_ms=10)
    with pytest.raises(ValueError, match="resume_after_ms"):
        DegradationAction(at_request=1, backend_index=0, action="kill_engine", resume_after_ms=10)


def test_goals_and_the_tables() -> None:
    fast = ActionReport("kill_pylon", 0, ["backend-0"], at_s=5.0, routable_s=0.2, left_routing=True)
    slow = ActionReport("freeze_pylon", 0, ["backend-0"], at_s=5.0, routable_s=8.0, left_routing=False)
    good, bad = FaultReport(10, 1, 0, actions=[fast]), FaultReport(10, 3, 2, ["x", "y"], [slow])
    assert goals_met(good) and not goals_met(bad)
    rows = summary_rows([("kill", good, None), ("freeze", bad, None), ("broken", None, "boom")])
    assert rows[0] == ["kill", "10", "1", "0", "0.2", "yes"]
    assert rows[1] == ["freeze", "10", "3", "2", ">= 8.0", "no"]
    assert rows[2][-1] == "run failed: boom"
    assert "| r | freeze_pylon | backend-0 | 5.0 | 10 | 3 | 2 | >= 8.0 |" in markdown_section([("r", bad)])


def test_a_killed_stargate_is_named_as_a_replica_and_has_no_routable_time() -> None:
    DegradationAction(at_request=150, backend_index=1, action="kill_stargate")
    killed = ActionReport("kill_stargate", 1, [], at_s=5.8)
    table = markdown_section([("r", FaultReport(400, 4, 0, actions=[killed]))])
    assert "| r | kill_stargate | sg-1 | 5.8 | 400 | 4 | 0 | - |" in table


def test_the_suite_runs_a_scenario_entry_or_the_recommended_deployment() -> None:
    scenario = load_scenario(resolve_scenario("fault-engine-kill"))
    narrowed, first = suite_run(scenario, None)
    assert first.name == "power-of-n" and first.lb_config == {"default": "power-of-n"}
    assert [entry.name for entry in narrowed.algorithms] == ["power-of-n"]
    _, recommended = suite_run(scenario, "recommended")
    entry = recommended.lb_config["models"]["dummy-model"]  # type: ignore[index]
    assert entry["algorithm"] == "wait-and-widen" and entry["load_aware"] is True
    assert "--default-max-wait-ms" in recommended.stargate_args
    assert "--stats-update-coalesce-ms" in recommended.pylon_args
