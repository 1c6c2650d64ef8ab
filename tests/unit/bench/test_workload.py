from __future__ import annotations

import copy
import itertools
import statistics
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from stargate.bench.schema import load_scenario, parse_scenario
from stargate.bench.traffic import LognormalTokens
from stargate.bench.workload import build_workload, poisson_gap_ms, round_half_away, sample_tokens, streams
from stargate.errors import ConfigError
from stargate.mock_engine.tokens import chat_prompt_bytes, text_token_estimate


def const(value: int) -> dict[str, Any]:
    return {"distribution": "constant", "value": value}


def scenario(traffic: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {
        "name": "Work Load",
        "model": "m",
        "request_count": 200,
        "max_concurrency": 4,
        "backends": {"count": 2, "profile": {
            "service_time_ms": {"ttft_mean": 1, "decode_tokens_per_s": 100},
            "registration": {"last_mean_input_tps": 1}}},
        "traffic_pattern": traffic,
        **top,
    }  # fmt: skip


HOTSET = {
    "kind": "zipf_hotset", "cache_affinity_keys": 50, "routing_keys": 3, "hotset_fraction": 0.1,
    "hotset_share": 0.8, "input_tokens": {"distribution": "uniform", "min": 10, "max": 500},
    "output_tokens": {"distribution": "lognormal", "mean": 40, "sigma": 0.5, "p99_cap": 90},
    "arrival": {"distribution": "poisson", "target_rps": 50},
}  # fmt: skip


def build(data: dict[str, Any], seed: int | None = None, base_dir: Path | None = None):  # type: ignore[no-untyped-def]
    return build_workload(parse_scenario(data, base_dir=base_dir), seed)


def test_same_seed_gives_the_identical_workload() -> None:
    assert build(scenario(HOTSET), 5) == build(scenario(HOTSET), 5)


def test_different_seeds_differ() -> None:
    a, b = build(scenario(HOTSET), 1).requests, build(scenario(HOTSET), 2).requests
    assert [r.at_ms for r in a] != [r.at_ms for r in b]
    assert [r.cache_affinity_key for r in a] != [r.cache_affinity_key for r in b]
    assert [r.body for r in a] != [r.body for r in b]


def test_output_sizes_do_not_shift_arrivals_keys_or_inputs() -> None:
    other = copy.deepcopy(HOTSET) | {"output_tokens": {"distribution": "uniform", "min": 1, "max": 1000}}
    a, b = build(scenario(HOTSET), 3).requests, build(scenario(other), 3).requests
    assert [r.at_ms for r in a] == [r.at_ms for r in b]
    assert [(r.cache_affinity_key, r.routing_key, r.input_tokens) for r in a] == [
        (r.cache_affinity_key, r.routing_key, r.input_tokens) for r in b
    ]
    assert [r.output_tokens for r in a] != [r.output_tokens for r in b]


def test_arrival_rate_does_not_shift_shapes() -> None:
    other = copy.deepcopy(HOTSET) | {"arrival": {"distribution": "constant", "interval_ms": 5}}
    a, b = build(scenario(HOTSET), 3).requests, build(scenario(other), 3).requests
    assert [r.at_ms for r in b] == [5.0 * i for i in range(200)]
    assert [(r.cache_affinity_key, r.output_tokens) for r in a] == [
        (r.cache_affinity_key, r.output_tokens) for r in b
    ]


def test_request_ids_headers_and_body() -> None:
    data = scenario(HOTSET, seed=77, client={"request_slo_ms": 60000, "max_wait_ms": 1000, "priority": 2,
                                             "headers": {"X-Tenant": "t1"}})  # fmt: skip
    work = build(data)
    first = work.requests[0]
    assert first.request_id == "work-load-77-000000" and first.at_ms == 0
    h = first.headers
    assert h["x-request-id"] == first.request_id and h["x-model"] == "m"
    assert (h["x-input-tokens"], h["x-output-tokens"]) == (str(first.input_tokens), str(first.output_tokens))
    assert h["x-cache-affinity-key"] == first.cache_affinity_key and h["x-routing-key"] == first.routing_key
    sent = (h["x-request-slo-ms"], h["x-max-wait-ms"], h["x-priority"], h["x-tenant"])
    assert sent == ("60000", "1000", "2", "t1")
    body = orjson.loads(first.body)
    assert body["stream"] is True and body["max_tokens"] == first.output_tokens and body["model"] == "m"
    assert work.mode == "open" and work.max_concurrency == 4 and work.sessions == ()


def test_hotset_mixture_keys() -> None:
    reqs = build(scenario(HOTSET | {"cache_affinity_keys": 100}) | {"request_count": 2000}).requests
    hot = [r for r in reqs if r.behavior_class == "hot"]
    assert all(int(r.cache_affinity_key[4:]) < 10 for r in hot)  # type: ignore[index]
    assert 0.75 < len(hot) / len(reqs) < 0.85
    assert all(r.routing_key in {"rk-0000", "rk-0001", "rk-0002"} for r in reqs)


def test_true_zipf_follows_the_power_law() -> None:
    traffic = {"kind": "zipf", "exponent": 1.0, "cache_affinity_keys": 20, "input_tokens": const(8),
               "output_tokens": const(2), "arrival": {"distribution": "constant",
                                                      "interval_ms": 0}}  # fmt: skip
    work = build(scenario(traffic) | {"request_count": 6000})
    counts = Counter(r.cache_affinity_key for r in work.requests)
    assert counts["cak-0000"] > counts["cak-0001"] > counts["cak-0004"] > counts["cak-0019"] > 0
    assert 1.6 < counts["cak-0000"] / counts["cak-0001"] < 2.4  # P(1)/P(2) = 2 for s = 1


def test_bursty_alternates_rates_starting_with_a_burst() -> None:
    traffic = {"kind": "bursty", "input_tokens": const(1), "output_tokens": const(1), "quiet_rps": 2,
               "burst_rps": 200, "burst_period_requests": 50}  # fmt: skip
    at = [r.at_ms for r in build(scenario(traffic)).requests]
    gaps = [b - a for a, b in itertools.pairwise(at)]  # type: ignore[operator]
    assert statistics.mean(gaps[:49]) < 20 < statistics.mean(gaps[50:99])
    assert all(float(g).is_integer() for g in gaps)


def test_distribution_rules() -> None:
    rng = streams(1)["input"]
    values = [sample_tokens(LognormalTokens(distribution="lognormal", mean=100, sigma=0.5, p99_cap=150), rng)
              for _ in range(4000)]  # fmt: skip
    assert max(values) == 150 and min(values) >= 1
    assert 90 <= statistics.median(values) <= 110  # mean is the median of the law
    assert (round_half_away(2.5), round_half_away(3.5), round_half_away(-0.5)) == (3, 4, -1)
    gaps = [poisson_gap_ms(100, rng) for _ in range(4000)]
    assert 9 < statistics.mean(gaps) < 11 and 0 in gaps


def test_prefix_reuse_grows_per_session_and_closed_loop_serializes_turns() -> None:
    traffic = {"kind": "prefix_reuse", "cache_affinity_keys": 3, "initial_input_tokens": const(100),
               "incremental_input_tokens": const(10), "output_tokens": const(2),
               "arrival": {"distribution": "constant", "interval_ms": 1}}  # fmt: skip
    data = scenario(traffic) | {"request_count": 30}
    open_work = build(data)
    by_key: dict[str, list[int]] = {}
    for r in sorted(open_work.requests, key=lambda r: r.index):
        by_key.setdefault(r.cache_affinity_key, []).append(r.input_tokens)  # type: ignore[arg-type]
    for sizes in by_key.values():
        assert sizes == [100 + 10 * i for i in range(len(sizes))]
    closed = build(data | {"execution": {"mode": "closed_loop", "workers": 2}})
    assert closed.mode == "closed" and closed.max_concurrency == 2 and len(closed.sessions) == 3
    for session in closed.sessions:
        assert [r.turn for r in session] == list(range(len(session)))
        assert all(r.at_ms is None for r in session)


SESSIONS = {"kind": "sessions", "turns": {"distribution": "uniform", "min": 1, "max": 4},
            "think_time_ms": const(250), "initial_input_tokens": const(400),
            "incremental_input_tokens": const(20), "output_tokens": const(8)}  # fmt: skip


def test_sessions_are_closed_loop_with_growing_context_and_think_time() -> None:
    work = build(scenario(SESSIONS, client={"timeout_s": 90}, execution={"workers": 32}))
    assert work.mode == "closed" and work.max_concurrency == 32 and work.client_timeout_s == 90
    assert sum(len(s) for s in work.sessions) == 200
    for session in work.sessions:
        keys = {r.cache_affinity_key for r in session}
        assert keys == {session[0].session}
        assert [r.input_tokens for r in session] == [400 + 28 * i for i in range(len(session))]
        assert [r.think_ms for r in session] == [0.0] + [250.0] * (len(session) - 1)


def _prompt(request: Any) -> bytes:
    return chat_prompt_bytes(orjson.loads(request.body)["messages"])


def test_prompt_text_matches_token_counts_and_shares_prefixes_within_a_session() -> None:
    work = build(scenario(SESSIONS, prompts={"shared_prefix_tokens": 64}))
    for session in work.sessions[:20]:
        texts = [_prompt(r) for r in session]
        for request, text in zip(session, texts, strict=True):
            assert text_token_estimate(text) == request.input_tokens
            assert len(text) == 4 * request.input_tokens
        for shorter, longer in itertools.pairwise(texts):
            assert longer.startswith(shorter[:-1])  # all but the closing NUL
    a, b = (_prompt(s[0]) for s in work.sessions[:2])
    assert a[: 64 * 4] == b[: 64 * 4]  # the shared system prompt
    assert a[64 * 4 : 64 * 4 + 64] != b[64 * 4 : 64 * 4 + 64]  # sessions diverge right after it


def test_repeat_mode_sends_the_original_filler() -> None:
    first = build(scenario(HOTSET, prompts={"text": "repeat"})).requests[0]
    assert orjson.loads(first.body)["messages"] == [{"role": "user", "content": "x" * first.input_tokens}]


def test_trace_replay_is_relative_to_the_scenario_file(tmp_path: Path) -> None:
    rows = [
        {"timestamp_ms": 1000, "session": "s1", "input_tokens": 50, "output_tokens": 3},
        {"timestamp_ms": 1500, "session": None, "input_tokens": 7, "output_tokens": 1, "prompt": "hello"},
        {"timestamp_ms": 1250, "session": "s1", "input_tokens": 60, "output_tokens": 2},
    ]
    (tmp_path / "t.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    data = scenario({"kind": "trace", "path": "t.jsonl", "time_scale": 2.0}) | {"request_count": 3}
    work = build(data, base_dir=tmp_path)
    planned = [(r.at_ms, r.session, r.turn) for r in work.requests]
    assert planned == [(0, "s1", 0), (500, "s1", 1), (1000, None, 0)]
    assert orjson.loads(work.requests[2].body)["messages"][0]["content"] == "hello"
    with pytest.raises(ConfigError, match="fewer than request_count"):
        build(data | {"request_count": 4}, base_dir=tmp_path)
    (tmp_path / "t.jsonl").write_text('{"timestamp_ms": 1}\n')
    with pytest.raises(ConfigError, match="bad trace line"):
        build(data | {"request_count": 1}, base_dir=tmp_path)


def test_trace_offsets_start_at_the_earliest_row_not_the_first(tmp_path: Path) -> None:
    row = {"session": None, "input_tokens": 4, "output_tokens": 1}
    rows = [{"timestamp_ms": t, **row} for t in (300, 0, 100)]
    (tmp_path / "t.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    data = scenario({"kind": "trace", "path": "t.jsonl"}) | {"request_count": 3}
    assert [r.at_ms for r in build(data, base_dir=tmp_path).requests] == [0, 100, 300]


def test_token_counts_over_the_limit_name_the_field_and_file(tmp_path: Path) -> None:
    huge = {"distribution": "uniform", "min": 10**11, "max": 10**11}
    path = tmp_path / "s.yaml"
    path.write_bytes(orjson.dumps(scenario({**HOTSET, "input_tokens": huge})))
    with pytest.raises(ConfigError, match="over the limit of 1000000") as error:
        build_workload(load_scenario(path))
    assert error.value.file == str(path) and error.value.path == "$.traffic_pattern.input_tokens"
    growing = {"kind": "prefix_reuse", "cache_affinity_keys": 1, "initial_input_tokens": const(900_000),
               "incremental_input_tokens": const(200_000), "output_tokens": const(1),
               "arrival": {"distribution": "constant", "interval_ms": 1}}  # fmt: skip
    with pytest.raises(ConfigError, match="request 1 would have 1100000") as error:
        build(scenario(growing))
    assert error.value.path == "$.traffic_pattern.incremental_input_tokens"
    lognormal = {"distribution": "lognormal", "mean": 1e300, "sigma": 50}
    with pytest.raises(ConfigError, match="over the limit") as error:
        build(scenario({**HOTSET, "output_tokens": lognormal}))
    assert error.value.path == "$.traffic_pattern.output_tokens"
    at_limit = scenario({**HOTSET, "input_tokens": const(1_000_000)}) | {"request_count": 1}
    assert build(at_limit).requests[0].input_tokens == 1_000_000


def test_trace_rows_over_the_token_limit_name_the_line(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"timestamp_ms": 0, "input_tokens": 1, "output_tokens": 1000001}\n')
    mooncake_row = '{"timestamp": 0, "input_length": 1000000000000, "output_length": 1, "hash_ids": []}\n'
    (tmp_path / "mc.jsonl").write_text(mooncake_row)
    cases = (("t.jsonl", "output_tokens", "stargate"), ("mc.jsonl", "input_length", "mooncake"))
    for name, field, fmt in cases:
        data = scenario({"kind": "trace", "path": name, "format": fmt}) | {"request_count": 1}
        with pytest.raises(ConfigError, match=f"{field} .* is over the limit of 1000000") as error:
            build(data, base_dir=tmp_path)
        assert f"{name}:1" in error.value.path


def test_mooncake_trace_rebuilds_prompts_and_keys_conversations(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 5000, "input_length": 600, "output_length": 40, "hash_ids": [1, 2]},
        {"timestamp": 5400, "input_length": 300, "output_length": 8, "hash_ids": [7]},
        {"timestamp": 6000, "input_length": 1100, "output_length": 20, "hash_ids": [1, 3, 4]},
    ]
    (tmp_path / "mc.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    traffic = {"kind": "trace", "format": "mooncake", "path": "mc.jsonl", "time_scale": 0.5}
    data = scenario(traffic) | {"request_count": 3}
    work = build(data, base_dir=tmp_path)
    assert [(r.at_ms, r.cache_affinity_key, r.turn) for r in work.requests] == [
        (0, "mc-0", 0), (200, "mc-1", 0), (500, "mc-0", 1)
    ]
    third = work.requests[2]
    assert third.headers["x-cache-affinity-key"] == "mc-0" and third.headers["x-input-tokens"] == "1100"
    prompts = [chat_prompt_bytes(orjson.loads(r.body)["messages"]) for r in work.requests]
    assert [len(p) for p in prompts] == [4 * 600, 4 * 300, 4 * 1100]
    assert prompts[0][: 5 + 2048] == prompts[2][: 5 + 2048] != prompts[1][: 5 + 2048]  # block 1 shared
    (tmp_path / "mc.jsonl").write_text('{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ConfigError, match="bad Mooncake trace line") as bad:
        build(data | {"request_count": 1}, base_dir=tmp_path)
    assert "mc.jsonl:1" in bad.value.describe()


def test_the_checked_in_synthetic_trace_replays() -> None:
    scenario_path = Path(__file__).resolve().parents[3] / "benches" / "trace-conversations.yaml"
    work = build_workload(load_scenario(scenario_path))
    keys = Counter(r.cache_affinity_key for r in work.requests)
    assert len(work.requests) == 343 and 100 <= len(keys) <= 140 and max(keys.values()) <= 6
    assert work.requests[-1].at_ms is not None and 20_000 < work.requests[-1].at_ms < 30_000


def test_a_schedule_over_a_day_is_refused_naming_the_trace(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
            {"timestamp": 1e300, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]}]  # fmt: skip
    (tmp_path / "mc.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    data = scenario({"kind": "trace", "format": "mooncake", "path": "mc.jsonl"}) | {"request_count": 2}
    limit = r"request 1 would start 1e\+297 s .* over the limit of 86400 s"
    with pytest.raises(ConfigError, match=limit) as error:
        build(data, base_dir=tmp_path)
    assert error.value.path.startswith("$.traffic_pattern.path (") and "mc.jsonl" in error.value.path
    # 25 h of rows replayed at a tenth of the pace is 2.5 h; a run stopped at 60 s waits for none past it
    rows[1]["timestamp"] = 25 * 3600 * 1000
    (tmp_path / "mc.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    with pytest.raises(ConfigError, match="after time_scale"):
        build(data, base_dir=tmp_path)
    scaled = data | {"traffic_pattern": data["traffic_pattern"] | {"time_scale": 0.1}}
    assert build(scaled, base_dir=tmp_path).requests[1].at_ms == 9_000_000
    assert len(build(data | {"execution": {"duration_s": 60}}, base_dir=tmp_path).requests) == 2
    slow = {**HOTSET, "arrival": {"distribution": "poisson", "target_rps": 1e-300}}
    with pytest.raises(ConfigError, match="over the limit of 86400 s") as error:
        build(scenario(slow))
    assert error.value.path == "$.traffic_pattern.arrival"
    with pytest.raises(ConfigError, match="would think") as error:
        build(scenario({**SESSIONS, "think_time_ms": const(10**17)}))
    assert error.value.path == "$.traffic_pattern.think_time_ms"


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"input_tokens": 100.9}, "input_tokens must be an integer, got 100.9"),
        ({"output_tokens": True}, "output_tokens must be an integer, got true"),
        ({"timestamp_ms": "5"}, 'timestamp_ms must be a finite number, got "5"'),
        ({"routing_key": 7}, "routing_key must be a string or null, got 7"),
        ({"session": ["s"]}, "session must be a string or null"),
    ],
)
def test_trace_values_of_the_wrong_type_name_the_field_and_line(
    tmp_path: Path, changed: dict[str, Any], message: str
) -> None:
    row = {"timestamp_ms": 0, "session": None, "input_tokens": 100, "output_tokens": 2} | changed
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(row) + b"\n")
    data = scenario({"kind": "trace", "path": "t.jsonl"}) | {"request_count": 1}
    with pytest.raises(ConfigError, match=message) as error:
        build(data, base_dir=tmp_path)
    assert "t.jsonl:1" in error.value.path


def test_trace_lengths_below_one_and_too_few_rows_name_the_field_and_file(tmp_path: Path) -> None:
    cases = [
        ("mooncake", {"timestamp": 1, "input_length": 600, "output_length": -1, "hash_ids": [1]},
         "output_length must be >= 1, got -1"),
        ("mooncake", {"timestamp": 1, "input_length": 0, "output_length": 5, "hash_ids": [1]},
         "input_length must be >= 1, got 0"),
        ("stargate", {"timestamp_ms": 1, "input_tokens": 0, "output_tokens": 5}, "input_tokens must be >= 1"),
    ]  # fmt: skip
    for fmt, row, message in cases:
        (tmp_path / "t.jsonl").write_bytes(orjson.dumps(row) + b"\n")
        data = scenario({"kind": "trace", "format": fmt, "path": "t.jsonl"}) | {"request_count": 1}
        with pytest.raises(ConfigError, match=message) as error:
            build(data, base_dir=tmp_path)
        assert "t.jsonl:1" in error.value.path
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(cases[2][1] | {"input_tokens": 3}) + b"\n")
    for fmt in ("stargate", "mooncake"):
        if fmt == "mooncake":
            (tmp_path / "t.jsonl").write_bytes(orjson.dumps(cases[0][1] | {"output_length": 3}) + b"\n")
        data = scenario({"kind": "trace", "format": fmt, "path": "t.jsonl"}) | {"request_count": 2}
        with pytest.raises(ConfigError, match="fewer than request_count") as error:
            build(data, base_dir=tmp_path)
        assert error.value.path == f"$.traffic_pattern.path ({(tmp_path / 't.jsonl').resolve()})"


@pytest.mark.parametrize("fmt", ["stargate", "mooncake"])
def test_a_trace_is_read_only_as_far_as_the_rows_replayed(tmp_path: Path, fmt: str) -> None:
    row = (
        {"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}
        if fmt == "mooncake"
        else {"timestamp_ms": 0, "input_tokens": 4, "output_tokens": 1}
    )
    rest = b"not a row, never read\n" * 800_000  # 17 MB
    (tmp_path / "t.jsonl").write_bytes(orjson.dumps(row) + b"\n" + orjson.dumps(row) + b"\n" + rest)
    data = scenario({"kind": "trace", "format": fmt, "path": "t.jsonl"}) | {"request_count": 2}
    tracemalloc.start()
    try:
        assert len(build(data, base_dir=tmp_path).requests) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4_000_000  # the whole file read and split into lines first: 67 MB
    with pytest.raises(ConfigError, match="cannot read trace"):
        build(data | {"traffic_pattern": data["traffic_pattern"] | {"path": "."}}, base_dir=tmp_path)
