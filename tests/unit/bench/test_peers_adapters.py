from __future__ import annotations

from pathlib import Path

import pytest

from stargate.bench.overhead import _request, overhead_scenario
from stargate.bench.peers.adapters import PeerRouterAdapter, parse_router_label
from stargate.bench.peers.compare import (
    PeerOptions,
    adapt_workload,
    body_limits,
    comparable_scenario,
    engine_args,
    resolve_routers,
)
from stargate.bench.workload import Workload
from stargate.errors import ConfigError


def test_parse_router_label() -> None:
    assert parse_router_label("direct") == ("direct", "round_robin")
    assert parse_router_label("stargate:wait-and-widen") == ("stargate", "wait-and-widen")
    assert parse_router_label("sglang:power_of_two") == ("sglang", "power_of_two")
    assert parse_router_label(" vllm:consistent_hash ") == ("vllm", "consistent_hash")
    assert parse_router_label("stargate-plain:recommended") == ("stargate", "recommended")
    with pytest.raises(ConfigError, match="unknown sglang policy 'consistent_hash'"):
        parse_router_label("sglang:consistent_hash")
    with pytest.raises(ConfigError, match="unknown router 'nginx'"):
        parse_router_label("nginx")
    with pytest.raises(ConfigError):
        parse_router_label("stargate:")


def test_resolve_routers_maps_bare_algorithms_and_rejects_unknown(tmp_path: Path) -> None:
    scenario = overhead_scenario()
    options = PeerOptions(root=tmp_path)
    choices = resolve_routers(scenario, "stargate:powerOf2,sglang:cache_aware,direct", options)
    assert [c.label for c in choices] == ["stargate:powerOf2", "sglang:cache_aware", "direct"]
    assert choices[0].spec.lb_config == {"default": "power-of-n"}
    assert choices[0].spec.name == "stargate:powerOf2"
    assert (tmp_path / "tokenizers" / scenario.model / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="unknown load-balancer algorithm"):
        resolve_routers(scenario, "stargate:fastest", options)
    with pytest.raises(ConfigError, match="twice"):
        resolve_routers(scenario, "direct,direct", options)


def test_a_peer_switches_the_mock_to_content_keyed_cache(tmp_path: Path) -> None:
    scenario = overhead_scenario()
    options = PeerOptions(root=tmp_path)
    only_stargate = resolve_routers(scenario, "stargate:random,direct", options)
    assert comparable_scenario(scenario, only_stargate) is scenario
    mixed = comparable_scenario(
        scenario, resolve_routers(scenario, "stargate:random,vllm:cache_aware", options)
    )
    assert mixed.mock.kv_mode == "prefix"
    assert scenario.mock.kv_mode == "affinity"


def test_a_plain_stargate_run_reads_the_body_and_is_sent_only_what_a_plain_client_sends(
    tmp_path: Path,
) -> None:
    scenario = overhead_scenario()
    options = PeerOptions(root=tmp_path)
    keyed, plain = resolve_routers(scenario, "stargate:recommended,stargate-plain:recommended", options)
    assert "--plain-clients" in plain.spec.stargate_args and "--plain-clients" not in keyed.spec.stargate_args
    assert plain.spec.lb_config == keyed.spec.lb_config
    req = _request(3)
    assert "x-input-tokens" in keyed.make().request_headers(req)
    assert plain.make().request_headers(req) == {
        "content-type": "application/json",
        "x-request-id": req.request_id,
    }
    # Its prompts are cached by their text, the ground truth a router that reads text is judged by.
    assert comparable_scenario(scenario, [keyed]) is scenario
    assert comparable_scenario(scenario, [keyed, plain]).mock.kv_mode == "prefix"


def test_engines_answer_as_long_as_planned_when_a_run_sends_no_output_length(tmp_path: Path) -> None:
    # A plain client sends no x-output-tokens, and sglang-router drops it: the engines then answer
    # up to the body's max_tokens, which may only shorten their default, so the default is raised.
    scenario, options = overhead_scenario(), PeerOptions(root=tmp_path)
    workload = Workload("open", (_request(1),), ((_request(1),),), 1, 30.0)
    for routers, limits in (
        ("stargate:recommended,direct", False),
        ("stargate:recommended,stargate-plain:recommended", True),
        ("stargate:recommended,sglang:cache_aware", True),
    ):
        assert body_limits(resolve_routers(scenario, routers, options)) is limits
    assert engine_args(workload, True) == ["--num-tokens", str(_request(1).output_tokens)]
    assert engine_args(workload, False) == []


def test_consistent_hash_gets_the_key_as_x_session_id(tmp_path: Path) -> None:
    req = _request(7)
    hashed = PeerRouterAdapter("vllm", "consistent_hash", tmp_path)
    assert hashed.request_headers(req)["x-session-id"] == "overhead-7"  # no session or key: the request id
    assert "x-session-id" not in PeerRouterAdapter("sglang", "cache_aware", tmp_path).request_headers(req)
    workload = Workload("open", (req,), ((req,),), 1, 30.0)
    adapted = adapt_workload(workload, hashed)
    assert adapted.requests[0].headers["x-session-id"] == "overhead-7"
    assert adapted.sessions[0][0] is adapted.requests[0]
    assert "x-session-id" not in req.headers


def test_peer_argv_points_at_the_workers_and_the_local_tokenizer(tmp_path: Path) -> None:
    sglang = PeerRouterAdapter("sglang", "cache_aware", tmp_path / "tok")
    argv = sglang.argv(Path("/venv/bin/sglang-router"), ["http://127.0.0.1:1", "http://127.0.0.1:2"], 5, 6)
    assert argv[:2] == ["/venv/bin/sglang-router", "launch"]
    joined = " ".join(argv)
    assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2 --policy cache_aware" in joined
    assert f"--model-path {tmp_path / 'tok'}" in joined and "--port 5" in joined
    vllm = PeerRouterAdapter("vllm", "round_robin", tmp_path).argv(
        Path("/v/vllm-router"), ["http://h:1"], 5, 6
    )
    assert vllm[0] == "/v/vllm-router" and "launch" not in vllm and "--model-path" not in vllm
    with pytest.raises(ConfigError):
        PeerRouterAdapter("direct", "round_robin", tmp_path)


def test_not_installed_peer_without_install_is_a_clear_error(tmp_path: Path) -> None:
    adapter = PeerRouterAdapter("sglang", "cache_aware", tmp_path, peers_root=tmp_path, install=False)
    with pytest.raises(Exception, match="not installed"):
        adapter.script()


def test_ground_truth_overrides_cache_and_engine_and_names_the_backend(tmp_path: Path) -> None:
    import dataclasses

    import orjson

    from stargate.bench.peers.ground_truth import apply_ground_truth, read_ground_truth
    from stargate.bench.score import RequestRecord

    path = tmp_path / "gt.jsonl"
    rows = [
        {"request_id": "a", "backend_id": "engine-2", "hit": True, "hit_tokens": 40},
        {"request_id": "b", "backend_id": "engine-0", "hit": False, "hit_tokens": 0},
    ]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + b'{"request_id": "c", "hi')
    truth = read_ground_truth(path)
    assert sorted(truth) == ["a", "b"]  # the torn last line is skipped
    base = RequestRecord(
        0, "a", "r", 0.0, 0.0, None, None, None, 200, None, None, None, None, False, 0, 8, 8, 1, 0
    )
    through_pylon = dataclasses.replace(base, request_id="b", backend_id="backend-1", cache_hit=True)
    unknown = dataclasses.replace(base, request_id="zzz")
    a, b, z = apply_ground_truth([base, through_pylon, unknown], truth)
    assert (a.engine_id, a.backend_id, a.cache_hit, a.cache_hit_tokens) == ("engine-2", "backend-2", True, 40)
    assert (b.backend_id, b.cache_hit) == ("backend-1", False)
    assert z == unknown
    assert read_ground_truth(tmp_path / "missing.jsonl") == {}
