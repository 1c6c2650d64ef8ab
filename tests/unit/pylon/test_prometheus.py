from __future__ import annotations

from stargate.pylon.stats.prometheus import apply_engine_metrics, parse_engine_metrics

from .helpers import make_rig

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="llama"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",model_name="llama"} 1.0
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama"} 1.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama"} 4.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="llama"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="llama"} 2000.0
"""


def test_vllm_metrics_published() -> None:
    rig = make_rig()
    assert apply_engine_metrics(rig.hub, parse_engine_metrics(VLLM)) == 1
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.num_running_queries) == (2, 5)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens, snap.kv_cache_free_tokens) == (
        1600,
        400,
        1200,
    )
    assert snap.stats_sources == ("engine_prometheus",)


def test_sglang_metrics_published() -> None:
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(SGLANG))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.num_running_queries) == (4, 5)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens) == (2000, 1000)


def test_own_tracking_wins_when_larger() -> None:
    rig = make_rig()
    for i in range(7):
        rig.load.track(f"r{i}", rig.gen, 0, 1)
    apply_engine_metrics(rig.hub, parse_engine_metrics(SGLANG))
    assert rig.hub.snapshot(rig.gen).queue_size == 7
