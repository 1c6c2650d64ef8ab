"""The fleet plan: engine and Pylon command lines and the runs of a scenario."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenario_data import base

from stargate.bench import plan
from stargate.bench.console import prepare_scenario
from stargate.bench.plan import token_delay_ms
from stargate.bench.schema import load_scenario, parse_scenario
from stargate.mock_engine.cli import build_parser
from stargate.pylon.config import parse_settings

BENCHES = sorted((Path(__file__).resolve().parents[3] / "benches").glob("*.yaml"))


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
    assert run.lb_config == {"default": "power-of-n", "models": {}}  # forwarded verbatim


def test_a_client_that_does_not_stream_gets_pylons_that_relay_json_answers() -> None:
    streaming = plan.backend_specs(parse_scenario(base()))[0].pylon_args
    assert "--pylon-relay-non-streaming" not in streaming
    args = plan.backend_specs(parse_scenario(base() | {"client": {"stream": False}}))[0].pylon_args
    assert args[args.index("--pylon-relay-non-streaming") + 1] == "true"


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


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.stem)
def test_generated_command_lines_parse_with_the_real_engine_and_pylon_clis(path: Path) -> None:
    scenario = load_scenario(path)
    engine_parser = build_parser()
    for engine in plan.engines(scenario):
        engine_parser.parse_args(engine.args)
    addresses = ["--upstream-http-base-url", "http://127.0.0.1:9", "--stargate-address", "127.0.0.1:1"]
    for run in plan.runs(scenario) or [None]:
        for backend in plan.backend_specs(scenario):
            parse_settings([*backend.pylon_args, *(run.pylon_args if run else []), *addresses], env={})


def test_mock_batching_override_reaches_every_engine_and_keeps_the_rest() -> None:
    shipped = load_scenario(BENCHES[0])
    sc = prepare_scenario(str(BENCHES[0]), None, 7, "vllm")
    assert sc.mock.batching == "vllm"
    assert sc.mock.kv_mode == shipped.mock.kv_mode
    assert sc.request_count == 7
    assert sc.base_dir == shipped.base_dir
    for engine in plan.engines(sc):
        assert engine.args[engine.args.index("--batching") + 1] == "vllm"
    assert prepare_scenario(str(BENCHES[0]), None, None).mock.batching == shipped.mock.batching
