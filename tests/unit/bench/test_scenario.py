from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from stargate.balancer.config import parse_lb_config
from stargate.bench import plan
from stargate.bench.plan import token_delay_ms
from stargate.bench.schema import load_scenario, parse_scenario
from stargate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
UPSTREAM = sorted(Path("/work/shared/upstream-benches").glob("*.yaml"))
BENCHES = sorted((ROOT / "benches").glob("*.yaml"))


def base() -> dict[str, Any]:
    return {
        "name": "Tiny Test",
        "model": "dummy-model",
        "request_count": 4,
        "max_concurrency": 2,
        "backends": {
            "count": 4,
            "pylons_per_cluster": 2,
            "cluster_id_template": "cluster-{cluster_index}",
            "profile": {
                "max_concurrent_requests": 3,
                "kv_cache_capacity_tokens": 1000,
                "service_time_ms": {"ttft_mean": 10, "decode_tokens_per_s": 260, "prefill_tokens_per_s": 500},
                "registration": {"last_mean_input_tps": 100},
            },
        },
        "traffic_pattern": {
            "kind": "uniform",
            "cache_affinity_keys": 2,
            "input_tokens": {"distribution": "constant", "value": 10},
            "output_tokens": {"distribution": "constant", "value": 2},
            "arrival": {"distribution": "constant", "interval_ms": 0},
        },
        "algorithms": [
            {"name": "a", "config": {"default": "power-of-n", "anything": {"goes": 1}},
             "pylon_queue_admission": {"enabled": False, "tolerance_factor": 1.5, "retry_after_ms": 5}},
        ],
    }  # fmt: skip


def with_change(path: list[str | int], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(base())
    node: Any = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


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


def test_grouped_cluster_shares_one_engine_with_multiplied_capacity() -> None:
    sc = parse_scenario(base())
    engines = plan.engines(sc)
    assert [e.engine_id for e in engines] == ["engine-0", "engine-2"]
    args = engines[0].args
    assert args[args.index("--max-concurrent-requests") + 1] == "6"
    assert args[args.index("--kv-cache-capacity-tokens") + 1] == "2000"
    assert args[args.index("--backend-id") + 1] == "engine-0"
    specs = plan.backend_specs(sc)
    last = specs[3]
    assert (last.backend_id, last.cluster_id, last.engine_id) == ("backend-3", "cluster-1", "engine-2")


def test_decode_delay_is_fractional_not_truncated() -> None:
    args = plan.engines(parse_scenario(base()))[0].args
    assert float(args[args.index("--token-delay-ms") + 1]) == pytest.approx(1000 / 260)
    assert token_delay_ms(85) == pytest.approx(11.7647, rel=1e-4)


def test_pylon_args_carry_identity_pinned_tps_concurrency_and_admission() -> None:
    sc = parse_scenario(base())
    args = plan.backend_specs(sc)[1].pylon_args
    assert args[args.index("--inference-server-id") + 1] == "backend-1"
    assert args[args.index("--cluster-id") + 1] == "cluster-0"
    assert args[args.index("--initial-input-tps") + 1] == "100"
    assert "--benchmark-pin-input-tps" in args
    assert args[args.index("--max-engine-concurrency") + 1] == "3"
    run = plan.runs(sc)[0]
    assert run.pylon_args == [
        "--pylon-queue-mismatch-retry-enabled=false",
        "--pylon-queue-mismatch-tolerance-factor", "1.5",
        "--pylon-queue-mismatch-retry-after-ms", "5",
    ]  # fmt: skip
    assert run.lb_config["anything"] == {"goes": 1}


def test_prefix_mode_adds_the_block_size_flag() -> None:
    data = base() | {"mock": {"kv_mode": "prefix", "block_tokens": 32, "batching": "continuous"}}
    args = plan.engines(parse_scenario(data))[0].args
    assert args[args.index("--kv-cache-mode") + 1] == "prefix"
    assert args[args.index("--kv-block-size") + 1] == "32"
    assert args[args.index("--batching") + 1] == "continuous"
    assert "--max-num-batched-tokens" not in args


def test_vllm_batching_passes_the_step_budget() -> None:
    data = base() | {"mock": {"batching": "vllm", "max_num_batched_tokens": 512}}
    args = plan.engines(parse_scenario(data))[0].args
    assert args[args.index("--batching") + 1] == "vllm"
    assert args[args.index("--max-num-batched-tokens") + 1] == "512"


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


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.stem)
def test_generated_command_lines_parse_with_the_real_engine_and_pylon_clis(path: Path) -> None:
    from stargate.mock_engine.cli import build_parser
    from stargate.pylon.config import parse_settings

    scenario = load_scenario(path)
    engine_parser = build_parser()
    for engine in plan.engines(scenario):
        engine_parser.parse_args(engine.args)
    addresses = ["--upstream-http-base-url", "http://127.0.0.1:9", "--stargate-address", "127.0.0.1:1"]
    for run in plan.runs(scenario) or [None]:
        for backend in plan.backend_specs(scenario):
            parse_settings([*backend.pylon_args, *(run.pylon_args if run else []), *addresses], env={})
