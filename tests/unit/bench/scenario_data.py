"""A small scenario as plain data (two clusters of two Pylons, one algorithm) and a way to vary it."""

from __future__ import annotations

import copy
from typing import Any


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
            {"name": "a", "config": {"default": "power-of-n", "models": {}},
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
