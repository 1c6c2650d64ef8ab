"""Scenario files: the original's schema loads unchanged, extensions validate, errors name the field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from scenario_data import base, with_change

from stargate.balancer.config import parse_lb_config
from stargate.bench import plan
from stargate.bench.schema import load_scenario, parse_scenario
from stargate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = sorted(Path("/work/shared/upstream-benches").glob("*.yaml"))
BENCHES = sorted((ROOT / "benches").glob("*.yaml"))


def test_upstream_files_are_present() -> None:
    assert len(UPSTREAM) == 17


@pytest.mark.parametrize("path", UPSTREAM, ids=lambda p: p.stem)
def test_every_upstream_scenario_loads_unchanged(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert len(plan.backend_specs(scenario)) == scenario.backends.count
    assert plan.runs(scenario)


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.stem)
def test_every_repo_scenario_loads_and_its_lb_configs_parse(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert scenario.metadata.description
    for run in plan.runs(scenario):
        parse_lb_config(run.lb_config)


def test_every_upstream_scenario_has_a_port_that_says_how_it_was_scaled() -> None:
    ported = {p.stem: load_scenario(p) for p in BENCHES}
    for path in UPSTREAM:
        description = ported[path.stem].metadata.description or ""
        assert "2 cores" in description or "Unchanged" in description, path.stem


def test_seed_scenario_matches_the_seed_workload() -> None:
    sc = load_scenario(ROOT / "benches" / "seed-waw-affinity-hold.yaml")
    assert (sc.request_count, sc.backends.count, sc.execution.workers) == (768, 4, 32)
    assert sc.backends.profile.max_concurrent_requests == 25
    assert (sc.client.timeout_s, sc.client.request_slo_ms, sc.client.max_wait_ms) == (90, 60000, 60000)
    models = [run.lb_config.get("models", {}) for run in plan.runs(sc)]
    waits = [m["dummy-model"].get("cache_affinity_wait_ms") for m in models if m]  # type: ignore[index]
    assert waits == [0, 200, 200]  # the last one with the load-aware fields


@pytest.mark.parametrize(
    ("data", "path", "reason"),
    [
        (with_change(["backends", "bogus"], 1), "$.backends.bogus", "unknown field"),
        (with_change(["traffic_pattern", "kind"], "zipf_hotset"), "$.traffic_pattern.hotset_fraction",
         "Field required"),
        (with_change(["traffic_pattern", "input_tokens"], {"distribution": "uniform", "min": 5, "max": 1}),
         "$.traffic_pattern.input_tokens", "min (5) must be <= max (1)"),
        (with_change(["backends", "cluster_id_template"], None), "$.backends", "cluster_id_template"),
        (with_change(["backends", "profiles"], [{"count": 1, "profile": base()["backends"]["profile"]}]),
         "$.backends", "must sum"),
        (with_change(["request_count"], 0), "$.request_count", "greater than 0"),
        (base() | {"client": {"headers": {"X-Request-Id": "mine"}}}, "$.client", "cannot be overridden"),
        (base() | {"degradation": {"actions": [{"at_request": 9, "backend_index": 0,
                                                "action": "delete_backend_pod"}]}}, "$", "at_request"),
    ],
)  # fmt: skip
def test_invalid_scenarios_name_the_field(data: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_scenario(data, file="s.yaml")
    assert info.value.file == "s.yaml"
    assert info.value.path == path
    assert reason in info.value.reason


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (["max_concurrency"], True, "$.max_concurrency"),
        (["request_count"], True, "$.request_count"),
        (["seed"], 1.0, "$.seed"),
        (["backends", "count"], "2", "$.backends.count"),
        (["client"], {"stream": "yes"}, "$.client.stream"),
        (["traffic_pattern", "arrival"], {"distribution": "constant", "interval_ms": "5"},
         "$.traffic_pattern.arrival.interval_ms"),
        (["backends", "profile", "registration", "last_mean_input_tps"], "100",
         "$.backends.profile.registration.last_mean_input_tps"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_not_converted(path: list[str], value: Any, field: str) -> None:
    """``true`` is not a count, ``"2"`` not a number, ``"yes"`` not a boolean, ``1.0`` not an integer."""
    with pytest.raises(ConfigError) as info:
        parse_scenario(with_change(path, value), file="s.yaml")
    assert (info.value.file, info.value.path) == ("s.yaml", field)
    assert "Input should be a valid" in info.value.reason


def test_grouped_cluster_with_different_profiles_is_rejected() -> None:
    other = copy.deepcopy(base()["backends"]["profile"]) | {"name": "other"}
    data = with_change(["backends", "profiles"], [
        {"count": 1, "profile": base()["backends"]["profile"]}, {"count": 3, "profile": other}])  # fmt: skip
    with pytest.raises(ConfigError, match="identical profiles"):
        parse_scenario(data)


def test_load_reports_the_file_and_yaml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_change(["max_concurrency"], -1)))
    with pytest.raises(ConfigError) as info:
        load_scenario(bad)
    assert str(bad) in str(info.value) and "$.max_concurrency" in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_scenario(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")


def test_every_problem_of_a_file_is_named_at_once() -> None:
    data = with_change(["max_concurrency"], -1)
    data["request_count"] = 0
    data["surprise"] = 1
    with pytest.raises(ConfigError) as info:
        parse_scenario(data, file="s.yaml")
    message = str(info.value)
    for named in ("$.max_concurrency: ", "$.request_count: ", "$.surprise: unknown field"):
        assert named in message


def test_select_algorithms_keeps_order_and_rejects_unknown() -> None:
    data = base()
    data["algorithms"] = [{"name": n, "config": {"default": n}} for n in ("random", "round-robin")]
    sc = parse_scenario(data)
    assert [r.name for r in plan.runs(sc.select_algorithms(["round-robin"]))] == ["round-robin"]
    with pytest.raises(ConfigError, match="available: random, round-robin"):
        sc.select_algorithms(["nope"])


def test_seed_precedence_and_mode_defaults() -> None:
    sc = parse_scenario(base() | {"seed": 9})
    assert (sc.effective_seed(None), sc.effective_seed(3)) == (9, 3)
    assert parse_scenario(base()).effective_seed() == 0
    assert sc.effective_mode == "open_loop"
    sessions = base() | {"traffic_pattern": {
        "kind": "sessions", "turns": {"distribution": "constant", "value": 2},
        "initial_input_tokens": {"distribution": "constant", "value": 5},
        "incremental_input_tokens": {"distribution": "constant", "value": 1},
        "output_tokens": {"distribution": "constant", "value": 1}}}  # fmt: skip
    assert parse_scenario(sessions).effective_mode == "closed_loop"
    with pytest.raises(ConfigError, match="closed_loop"):
        parse_scenario(sessions | {"execution": {"mode": "open_loop"}})


def test_a_scenario_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"name: x\n\x00\xff\xfe")
    with pytest.raises(ConfigError) as raised:
        load_scenario(path)
    assert str(path) in raised.value.describe() and "UTF-8" in raised.value.describe()


def test_an_algorithm_config_stargate_would_refuse_is_refused_here() -> None:
    """``validate`` and ``run`` fail it before any fleet starts, naming the entry and the field."""
    data = with_change(["algorithms"], [{"name": "a", "config": {"default": "sticky"}}])
    with pytest.raises(ConfigError) as info:
        parse_scenario(data)
    assert info.value.path == "$.algorithms[0].config" and "$.default" in info.value.reason


def test_a_request_count_past_the_bound_is_refused_before_planning() -> None:
    """The whole workload is built in memory first: 10^23 requests never finished planning."""
    with pytest.raises(ConfigError) as info:
        parse_scenario(with_change(["request_count"], 10**23))
    assert info.value.path == "$.request_count"
