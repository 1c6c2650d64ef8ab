from __future__ import annotations

from typing import Any

import pytest

from stargate.bench.schema import Scenario, parse_scenario
from stargate.bench.score import (
    RequestRecord,
    coefficient_of_variation,
    equal_share_balance,
    jain_index,
    max_over_mean,
    parity_equal_balance,
    percentile,
    summarize,
    tvd_balance,
)


def make_scenario(tps: tuple[float, ...] = (100, 100, 200, 200)) -> Scenario:
    profiles = [
        {"count": 1, "profile": {"service_time_ms": {"ttft_mean": 1, "decode_tokens_per_s": 10},
                                 "registration": {"last_mean_input_tps": t}}}
        for t in tps
    ]  # fmt: skip
    return parse_scenario({
        "name": "s", "model": "m", "request_count": 8, "max_concurrency": 2,
        "backends": {"count": len(tps), "profile": profiles[0]["profile"], "profiles": profiles},
        "traffic_pattern": {"kind": "uniform", "input_tokens": {"distribution": "constant", "value": 1},
                            "output_tokens": {"distribution": "constant", "value": 1},
                            "arrival": {"distribution": "constant", "interval_ms": 0}},
    })  # fmt: skip


def record(index: int, backend: str | None = "backend-0", **kw: Any) -> RequestRecord:
    values: dict[str, Any] = dict(
        index=index, request_id=f"r{index}", run="x", scheduled_s=0.0, dispatch_s=0.0, headers_s=0.05,
        first_token_s=0.1, last_token_s=0.5, status=200, error_class=None, backend_id=backend,
        cluster_id=None, engine_id=None, cache_hit=None, cache_hit_tokens=None, input_tokens=100,
        output_tokens=5, chunks=5, retries_seen=0,
    )  # fmt: skip
    values.update(kw)
    return RequestRecord(**values)


def test_percentile_uses_half_away_from_zero_index() -> None:
    values = list(range(768))
    assert percentile(values, 0.99) == 759  # round(767 * .99 = 759.33)
    assert percentile([10, 20, 30, 40], 0.5) == 30  # index 1.5 -> 2 (banker's rounding would give 20)
    assert percentile([10, 20, 30, 40, 50, 60], 0.9) == 60  # 4.5 -> 5
    assert percentile([], 0.5) is None


def test_balance_formulas_by_hand() -> None:
    # all load on one of four backends: TVD = 1/2 (|1 - 1/4| + 3 * 1/4) = 3/4
    collapsed = {"a": 4.0, "b": 0.0, "c": 0.0, "d": 0.0}
    assert equal_share_balance(collapsed) == pytest.approx(0.25)
    assert parity_equal_balance(collapsed) == 1.0  # the original's flaw
    assert jain_index(collapsed.values()) == pytest.approx(0.25)  # 16 / (4 * 16)
    assert coefficient_of_variation(collapsed.values()) == pytest.approx(3 ** 0.5)  # pstdev 1.732 / mean 1
    assert max_over_mean(collapsed.values()) == pytest.approx(4.0)
    uneven = {"a": 3.0, "b": 1.0}
    assert equal_share_balance(uneven) == pytest.approx(0.75)  # 1 - 1/2 (.25 + .25)
    assert parity_equal_balance(uneven) == pytest.approx(0.5)  # 1 - (.25 + .25)
    assert jain_index(uneven.values()) == pytest.approx(16 / 20)
    assert tvd_balance({"a": 0.5, "b": 0.5}, {"a": 0.2, "c": 0.8}) == pytest.approx(0.2)  # 1 - (.3+.5+.8)/2
    assert tvd_balance({}, {"a": 1.0}) is None
    assert jain_index([0.0, 0.0]) is None


def test_summary_latencies_throughput_and_goodput() -> None:
    records = [
        record(0, dispatch_s=0.0, first_token_s=0.1, last_token_s=0.5, end_s=0.5, scheduled_s=0.0),
        record(1, dispatch_s=1.0, first_token_s=1.3, last_token_s=2.0, end_s=2.0, scheduled_s=0.5),
        record(2, dispatch_s=2.0, first_token_s=2.6, last_token_s=4.0, end_s=4.0, scheduled_s=2.0, chunks=3),
        record(3, dispatch_s=3.0, scheduled_s=3.0, first_token_s=None, last_token_s=None, end_s=3.2,
               status=503, error_class="http_503", backend_id=None),
    ]  # fmt: skip
    s = summarize("x", records, make_scenario(), 4.5, slo_ttft_ms=350)
    assert (s.request_count, s.success_count, s.success_rate) == (4, 3, 0.75)
    assert s.total_length_s == pytest.approx(4.0)  # first dispatch 0 -> last end 4.0
    assert s.requests_per_second == pytest.approx(3 / 4)
    assert s.output_tokens_per_second == pytest.approx(13 / 4)  # delivered chunks 5 + 5 + 3
    assert s.planned_output_tokens_per_second == pytest.approx(15 / 4)
    assert s.avg_ttft_ms == pytest.approx((100 + 300 + 600) / 3)
    assert (s.p50_ttft_ms, s.p99_ttft_ms) == pytest.approx((300, 600))
    assert s.p50_ttlt_ms == pytest.approx(1000)  # sorted 200 500 1000 2000 (the failure counts) -> index 2
    assert s.max_ttlt_ms == pytest.approx(2000)
    assert s.p50_tpot_ms == pytest.approx(175)  # 400/4 = 100, 700/4 = 175, 1400/2 = 700 -> index 1
    assert s.max_schedule_lag_ms == pytest.approx(500)
    assert s.slo_attainment == pytest.approx(2 / 4) and s.goodput_rps == pytest.approx(2 / 4)
    assert s.timeouts == 0
    assert s.failures == [{"status": 503, "backend_id": None, "error_class": "http_503", "count": 1}]


def test_balance_counts_idle_backends_and_capacity() -> None:
    records = [record(i, "backend-0") for i in range(3)] + [record(3, "backend-2")]
    s = summarize("x", records, make_scenario(), 1.0, None)
    # successes 3,0,1,0 over four backends: shares .75 0 .25 0 vs equal .25 -> TVD (.5+.25+0+.25)/2
    assert s.equal_balance == pytest.approx(0.5)
    # capacity shares 1/6 1/6 1/3 1/3 -> TVD (|.75-1/6| + 1/6 + |.25-1/3| + 1/3)/2 = 7/12
    assert s.capacity_balance == pytest.approx(1 - 7 / 12)
    assert s.jain_index == pytest.approx(16 / (4 * 10))
    assert s.max_over_mean == pytest.approx(3.0)
    assert [b.member_id for b in s.backends] == ["backend-0", "backend-1", "backend-2", "backend-3"]
    assert [b.success_count for b in s.backends] == [3, 0, 1, 0]
    assert s.parity_equal_balance == pytest.approx(0.5)  # 1 - (.25 + .25) over the two present
    # all four in flight together over [0, 0.5): 3 on backend-0 of four backends -> 3 / (4/4)
    assert (s.inflight_imbalance, s.inflight_imbalance_p99) == (3.0, 3.0)


def test_prefill_imbalance_counts_requests_until_their_first_token() -> None:
    records = [
        record(0, "backend-0", first_token_s=1.0, last_token_s=1.0),
        record(1, "backend-0", first_token_s=1.0, last_token_s=1.0),
        record(2, "backend-1", first_token_s=1.0, last_token_s=2.0),
        # failed before a first token: waiting for it until its end
        record(3, "backend-2", first_token_s=None, last_token_s=None, end_s=1.0, status=502,
               error_class="http_502"),
    ]  # fmt: skip
    s = summarize("x", records, make_scenario(), 2.0, None)
    # [0, 1): 2, 1, 1, 0 waiting on four backends -> 2 / (4/4); nothing waits after 1
    assert s.prefill_inflight_imbalance == pytest.approx(2.0)
    # in flight, [1, 2) adds backend-1 holding the only request, decoding: 1 / (1/4)
    assert s.inflight_imbalance == pytest.approx((2.0 + 4.0) / 2)


def test_cache_rates_and_stickiness() -> None:
    records = [
        record(0, "backend-0", cache_hit=False, cache_hit_tokens=0, cache_affinity_key="k1",
               evicted_entries=1, evicted_tokens=40),
        record(1, "backend-0", cache_hit=True, cache_hit_tokens=90, cache_affinity_key="k1"),
        record(2, "backend-1", cache_hit=True, cache_hit_tokens=30, cache_affinity_key="k1"),
        record(3, "backend-1", cache_hit=False, cache_hit_tokens=0, cache_affinity_key="k2"),
        record(4, "backend-1"),
    ]  # fmt: skip
    s = summarize("x", records, make_scenario(), 1.0, None)
    assert (s.cache_observed, s.cache_hits, s.cache_misses) == (4, 2, 2)
    assert s.cache_hit_rate == pytest.approx(0.5)
    assert s.reused_input_tokens == 120 and s.uncached_input_tokens == 280
    assert s.input_reuse_rate == pytest.approx(120 / 400)
    assert (s.evicted_entries, s.evicted_tokens) == (1, 40)
    assert s.moved_cache_keys == 1 and s.cache_key_movement_rate == pytest.approx(0.5)
    assert s.slo_ttft_ms is None and s.goodput_rps is None


def test_engine_attribution_for_routers_without_pylons() -> None:
    records = [record(i, None, engine_id="engine-1") for i in range(2)]
    s = summarize("x", records, make_scenario(), 1.0, None, pylons_in_path=False)
    assert [b.member_id for b in s.backends] == ["engine-0", "engine-1", "engine-2", "engine-3"]
    assert s.equal_balance == pytest.approx(0.25)


def grouped_scenario() -> Scenario:
    """Two engines, each behind two Pylons (backend-0 and -1 front engine-0, backend-2 and -3 engine-2)."""
    return parse_scenario({
        "name": "g", "model": "m", "request_count": 4, "max_concurrency": 4,
        "backends": {"count": 4, "pylons_per_cluster": 2, "cluster_id_template": "cluster-{cluster_index}",
                     "profile": {"max_concurrent_requests": 6,
                                 "service_time_ms": {"ttft_mean": 1, "decode_tokens_per_s": 10},
                                 "registration": {"last_mean_input_tps": 100}}},
        "traffic_pattern": {"kind": "uniform", "input_tokens": {"distribution": "constant", "value": 1},
                            "output_tokens": {"distribution": "constant", "value": 1},
                            "arrival": {"distribution": "constant", "interval_ms": 0}},
    })  # fmt: skip


def test_a_router_without_pylons_is_scored_over_the_engines_on_grouped_pylons() -> None:
    """Its records' backend ids are named after the engines (backend-0, backend-2), yet are Pylons."""
    records = [record(i, f"backend-{2 * (i % 2)}", engine_id=f"engine-{2 * (i % 2)}") for i in range(4)]
    s = summarize("direct", records, grouped_scenario(), 1.0, None, pylons_in_path=False)
    assert [(b.member_id, b.success_count) for b in s.backends] == [("engine-0", 2), ("engine-2", 2)]
    assert s.equal_balance == pytest.approx(1.0) and s.jain_index == pytest.approx(1.0)
    assert (s.inflight_imbalance, s.inflight_imbalance_p99) == (1.0, 1.0)
    assert (s.slot_inflight_imbalance, s.prefill_inflight_imbalance) == (1.0, 1.0)
    assert [(c.member_id, c.request_share) for c in s.clusters] == [("cluster-0", 0.5), ("cluster-1", 0.5)]


def test_a_stargate_run_is_scored_over_the_pylons_on_grouped_pylons() -> None:
    records = [record(i, f"backend-{i % 2}", engine_id="engine-0") for i in range(4)]
    s = summarize("x", records, grouped_scenario(), 1.0, None)
    assert [b.member_id for b in s.backends] == ["backend-0", "backend-1", "backend-2", "backend-3"]
    assert s.equal_balance == pytest.approx(0.5)  # one engine's two Pylons took everything
    assert s.inflight_imbalance == pytest.approx(2.0)
    assert [(c.member_id, c.request_share) for c in s.clusters] == [("cluster-0", 1.0), ("cluster-1", 0.0)]


def test_requests_in_flight_are_counted_per_engine_for_every_router() -> None:
    """Pile-ups happen on engines: a Stargate run even over the two engines, each through one of
    its two Pylons, is as even as a router without Pylons doing the same (it read 2.0 over Pylons)."""
    records = [record(i, f"backend-{2 * (i % 2)}", engine_id=f"engine-{2 * (i % 2)}") for i in range(4)]
    stargate = summarize("x", records, grouped_scenario(), 1.0, None)
    direct = summarize("direct", records, grouped_scenario(), 1.0, None, pylons_in_path=False)
    assert stargate.equal_balance == pytest.approx(0.5)  # the spec's Pylon balance: two of four idle
    for s in (stargate, direct):
        figures = (s.inflight_imbalance, s.slot_inflight_imbalance, s.prefill_inflight_imbalance)
        assert figures == (1.0, 1.0, 1.0)


def test_record_round_trip_ignores_unknown_keys() -> None:
    r = record(1, cache_affinity_key="k")
    assert RequestRecord.from_dict(r.to_dict() | {"future": 1}) == r
    assert not record(2, status=200, error_class="stream_cut").ok
