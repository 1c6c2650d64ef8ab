"""Engine stats from a stock vLLM or SGLang Prometheus ``/metrics`` endpoint.

With ``--engine-stats-source prometheus`` Pylon works in front of an unmodified engine: the
engine's running/waiting counts and KV occupancy are polled on an interval; throughput comes
from OpenAI chunk usage (fallback math). Series carrying a ``model_name`` label update that
model; unlabelled series update every current model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from stargate.pylon.stats.aggregate import SRC_PROMETHEUS
from stargate.pylon.stats.hub import EngineLoad, StatsHub

log = logging.getLogger("stargate.pylon.prometheus")

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
KV_CAPACITY = ("sglang:max_total_num_tokens",)
CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(slots=True)
class EngineMetrics:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    kv_capacity: int | None = None

    @property
    def kv(self) -> tuple[int, int, int] | None:
        if self.kv_capacity is None or self.kv_usage is None:
            return None
        used = min(self.kv_capacity, max(0, round(self.kv_capacity * self.kv_usage)))
        return self.kv_capacity, used, self.kv_capacity - used


def parse_engine_metrics(text: str) -> dict[str | None, EngineMetrics]:
    """Per ``model_name`` label (None = unlabelled) engine numbers from Prometheus text."""
    out: dict[str | None, EngineMetrics] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            model = sample.labels.get("model_name")
            m = out.setdefault(model, EngineMetrics())
            if name in RUNNING:
                m.running += sample.value
            elif name in WAITING:
                m.waiting += sample.value
            elif name in KV_USAGE:
                m.kv_usage = sample.value
            elif name in KV_CAPACITY:
                m.kv_capacity = int(sample.value)
            elif name == CACHE_CONFIG:
                blocks = sample.labels.get("num_gpu_blocks", "")
                size = sample.labels.get("block_size", "")
                if blocks.isdigit() and size.isdigit():
                    m.kv_capacity = int(blocks) * int(size)
    return out


def _merge(specific: EngineMetrics, unlabelled: EngineMetrics | None) -> EngineMetrics:
    if unlabelled is None:
        return specific
    return EngineMetrics(
        specific.running or unlabelled.running,
        specific.waiting or unlabelled.waiting,
        specific.kv_usage if specific.kv_usage is not None else unlabelled.kv_usage,
        specific.kv_capacity if specific.kv_capacity is not None else unlabelled.kv_capacity,
    )


def apply_engine_metrics(hub: StatsHub, parsed: dict[str | None, EngineMetrics]) -> int:
    """Feed parsed numbers to the hub; returns how many models were updated."""
    updated = 0
    unlabelled = parsed.get(None)
    for model in hub.registry.model_ids():
        specific = parsed.get(model)
        if specific is None and unlabelled is None:
            continue
        m = _merge(specific or EngineMetrics(), unlabelled)
        hub.on_engine_load(model, EngineLoad(int(m.running), int(m.waiting)))
        kv = m.kv
        if kv is not None:
            hub.on_kv(model, *kv, source=SRC_PROMETHEUS)
        updated += 1
    return updated


async def run_prometheus_poller(
    session: aiohttp.ClientSession,
    url: str,
    hub: StatsHub,
    *,
    interval_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(interval_s, 1.0))) as resp:
                if 200 <= resp.status < 300:
                    apply_engine_metrics(hub, parse_engine_metrics(await resp.text()))
                else:
                    log.debug("engine metrics %s answered %s", url, resp.status)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("engine metrics poll failed: %s", exc)
        await sleep(interval_s)
