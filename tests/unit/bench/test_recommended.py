"""``examples/lb-config/recommended.json``: valid, one model entry, and what the demo and
``stargate-bench compare --routers stargate:recommended`` run."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from stargate.balancer.config import load_lb_config, parse_lb_config
from stargate.bench import plan
from stargate.bench.console import prepare_scenario
from stargate.bench.peers.compare import (
    PREFILL_SHARING_SETTINGS,
    RECOMMENDED_FILE,
    RECOMMENDED_STARGATE_ARGS,
    SHARED_PREFILL_SETTINGS,
    PeerOptions,
    recommended_lb_config,
    resolve_routers,
)
from stargate.bench.schema import load_scenario
from stargate.bench.serve import serve_run, serve_scenario
from stargate.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_recommended_file_loads_and_enables_the_load_aware_fields() -> None:
    definition = load_lb_config(str(RECOMMENDED_FILE)).resolve("llama", None)
    assert definition.load_aware
    assert definition.cache_affinity_placement.value == "load"
    assert definition.cache_affinity_spill
    # Engines that start every prefill at once add these (docs/configuration.md).
    assert definition.cache_affinity_yield_margin_ms is None
    assert not definition.cache_affinity_await_prefill


def test_demo_runs_the_recommended_config_first() -> None:
    demo = load_scenario(ROOT / "benches" / "demo.yaml")
    first = plan.runs(demo)[0]
    assert first.name == "recommended"
    assert first.lb_config == recommended_lb_config(demo.model)


def test_a_recommended_file_without_exactly_one_model_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "two.json"
    path.write_bytes(orjson.dumps({"models": {"a": {"algorithm": "random"}, "b": {"algorithm": "random"}}}))
    with pytest.raises(ConfigError, match="recommended"):
        recommended_lb_config("m", path=path)


def _without_shared_prefill(lb_config: dict[str, object]) -> dict[str, object]:
    """The lb-config without the settings ``compare`` adds for the mock engines' batching."""
    added = SHARED_PREFILL_SETTINGS.keys() | PREFILL_SHARING_SETTINGS.keys()
    models = lb_config["models"]
    assert isinstance(models, dict)
    return {**lb_config, "models": {name: {k: v for k, v in entry.items() if k not in added}
                                    for name, entry in models.items()}}  # fmt: skip


def test_compare_runs_recommended_with_its_router_flag() -> None:
    scenario = prepare_scenario(str(ROOT / "benches" / "uniform-4-backends.yaml"), None, None, "vllm")
    (choice,) = resolve_routers(scenario, "stargate:recommended", PeerOptions())
    assert choice.spec.lb_config == recommended_lb_config(scenario.model)
    assert choice.spec.stargate_args == RECOMMENDED_STARGATE_ARGS == ("--default-max-wait-ms", "60000")


def test_the_demo_entry_named_recommended_also_runs_with_the_router_flag() -> None:
    demo = load_scenario(ROOT / "benches" / "demo.yaml")
    (choice,) = resolve_routers(demo, "stargate:recommended", PeerOptions())
    assert choice.spec.stargate_args == RECOMMENDED_STARGATE_ARGS


def test_several_stargates_run_the_recommended_config_unchanged() -> None:
    # Replicas follow each other's placements through Pylon's published routes: placement by load
    # needs no ring for them to agree.
    multi = load_scenario(ROOT / "benches" / "lb-balance-prefix-reuse-4c2p-2s.yaml")
    assert multi.stargates.count > 1
    (choice,) = resolve_routers(multi, "stargate:recommended", PeerOptions())
    assert _without_shared_prefill(choice.spec.lb_config) == recommended_lb_config(multi.model)
    assert "--stats-update-coalesce-ms" in choice.spec.pylon_args
    # Its engines keep a KV cache: Pylon publishes the prompt work their caches do not hold.
    assert choice.spec.pylon_args[-2:] == ["--engine-prefix-caching", "true"]
    definition = parse_lb_config(choice.spec.lb_config).resolve(multi.model, None)
    assert definition.cache_affinity_placement.value == "load"


def test_engines_without_a_kv_cache_run_pylon_without_prefix_caching() -> None:
    scenario = load_scenario(ROOT / "benches" / "queue-mismatch-retry-ab.yaml")
    assert scenario.backends.profile_of(0).kv_cache_capacity_tokens == 0
    (choice,) = resolve_routers(scenario, "stargate:recommended", PeerOptions())
    assert "--engine-prefix-caching" not in choice.spec.pylon_args
    assert choice.spec.lb_config == recommended_lb_config(scenario.model)  # nothing cached to wait for


@pytest.mark.parametrize(
    ("batching", "awaits", "shares"),
    [("continuous", True, True), ("independent", True, False), ("vllm", False, False)],
)
def test_a_turn_waits_and_yields_to_load_where_engines_start_every_prefill_at_once(
    batching: str, awaits: bool, shares: bool
) -> None:
    path = str(ROOT / "benches" / "trace-conversations.yaml")
    scenario = prepare_scenario(path, None, None, batching)  # type: ignore[arg-type]
    (choice,) = resolve_routers(scenario, "stargate:recommended", PeerOptions())
    definition = parse_lb_config(choice.spec.lb_config).resolve(scenario.model, None)
    assert definition.cache_affinity_await_prefill is awaits
    assert definition.cache_affinity_yield_margin_ms == (1000 if awaits else None)
    # Only engines that share their prefill rate between prompts slow the ones a request joins.
    assert definition.prefill_sharing is shares
    assert _without_shared_prefill(choice.spec.lb_config) == recommended_lb_config(scenario.model)


def test_clients_that_do_not_stream_get_no_wait_for_a_first_byte() -> None:
    scenario = prepare_scenario(str(ROOT / "benches" / "trace-conversations.yaml"), None, None, "continuous")
    quiet = scenario.model_copy(update={"client": scenario.client.model_copy(update={"stream": False})})
    (choice,) = resolve_routers(quiet, "stargate:recommended", PeerOptions())
    assert not parse_lb_config(choice.spec.lb_config).resolve(quiet.model, None).cache_affinity_await_prefill


def test_serve_runs_the_recommended_deployment_unless_given_a_file(tmp_path: Path) -> None:
    scenario = serve_scenario(2, "my-model", 16)
    assert scenario.mock.kv_mode == "prefix"  # any client: cached by prompt text, as engines do
    run = serve_run(scenario, None, plain=True)
    definition = parse_lb_config(run.lb_config).resolve("my-model", None)
    assert definition.load_aware and definition.cache_affinity_placement.value == "load"
    # Its clients need not stream: no request waits for another's first byte (a whole answer).
    assert run.lb_config == recommended_lb_config("my-model")
    assert run.stargate_args == (*RECOMMENDED_STARGATE_ARGS, "--plain-clients")
    assert "--stats-update-coalesce-ms" in run.pylon_args and "--pylon-relay-non-streaming" in run.pylon_args

    path = tmp_path / "lb.json"
    path.write_bytes(orjson.dumps({"default": "round-robin"}))
    given = serve_run(scenario, path, plain=False)
    assert (given.lb_config, given.pylon_args, given.stargate_args) == ({"default": "round-robin"}, [], ())
    path.write_bytes(orjson.dumps({"default": "no-such-algorithm"}))
    with pytest.raises(ConfigError, match=r"lb\.json"):
        serve_run(scenario, path, plain=True)
