"""Engine stats from a stock vLLM or SGLang Prometheus ``/metrics`` endpoint.

With ``--engine-stats-source prometheus`` Pylon works in front of an unmodified engine: the
engine's running/waiting counts and KV occupancy are polled on an interval; throughput comes
from OpenAI chunk usage (fallback math). Series carrying a ``model_name`` (or older SGLang's
``name``) label update that model; unlabelled series update every current model.

One quantity may be exported under several names (vLLM's and SGLang's, old and new): the
series of one name are summed (data-parallel ranks each export their own), and the names of one
quantity are never added together — the largest wins. An engine that exports both families
(the mock engine does) is therefore counted once. A page that cannot be had, or that carries none
of these series (a wrong ``--engine-metrics-path``, another engine), is logged once until it is.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from stargate.pylon.load import EngineLoad
from stargate.pylon.stats.aggregate import SRC_PROMETHEUS
from stargate.pylon.stats.hub import StatsHub
from stargate.wire.limits import U64_MAX
from stargate.wire.link_log import LinkLog

log = logging.getLogger("stargate.pylon.prometheus")

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
KV_USED = ("sglang:num_used_tokens",)
KV_CAPACITY = ("sglang:max_total_num_tokens", "vllm:cache_config_info")
CACHE_CONFIG = "vllm:cache_config_info"
FRACTIONS = frozenset(KV_USAGE)
KNOWN = frozenset((*RUNNING, *WAITING, *KV_USAGE, *KV_USED, *KV_CAPACITY))
MODEL_LABELS = ("model_name", "name")


def _count(value: float) -> int:
    """A gauge as a u64: negative → 0, huge or infinite → u64 max (NaN never gets here)."""
    if value <= 0:
        return 0
    return U64_MAX if value >= U64_MAX else int(value)


@dataclass(slots=True)
class EngineMetrics:
    """Per metric name: the sum over its series (fractions: the mean), and how many series."""

    sums: dict[str, float] = field(default_factory=dict)
    series: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.series[name] = self.series.get(name, 0) + 1

    def value(self, name: str) -> float | None:
        total = self.sums.get(name)
        if total is None:
            return None
        return total / self.series[name] if name in FRACTIONS else total

    def largest(self, names: tuple[str, ...]) -> float | None:
        """The largest value among the aliases of one quantity (never their sum)."""
        found = [v for n in names if (v := self.value(n)) is not None]
        return max(found) if found else None

    @property
    def running(self) -> int | None:
        value = self.largest(RUNNING)
        return None if value is None else _count(value)

    @property
    def waiting(self) -> int | None:
        value = self.largest(WAITING)
        return None if value is None else _count(value)

    @property
    def kv(self) -> tuple[int, int, int] | None:
        capacity = self.largest(KV_CAPACITY)
        if capacity is None:
            return None
        cap = _count(capacity)
        used_tokens = self.largest(KV_USED)
        usage = self.largest(KV_USAGE)
        if used_tokens is not None:
            used = _count(used_tokens)
        elif usage is not None:
            used = _count(round(cap * min(max(usage, 0.0), 1.0)))
        else:
            return None
        used = min(used, cap)
        return cap, used, cap - used

    def fill_from(self, other: EngineMetrics) -> EngineMetrics:
        """This model's names, completed by the unlabelled names it lacks."""
        merged = EngineMetrics(dict(self.sums), dict(self.series))
        for name, total in other.sums.items():
            if name not in merged.sums:
                merged.sums[name] = total
                merged.series[name] = other.series[name]
        return merged


def _sample_value(name: str, labels: dict[str, str], value: float) -> float | None:
    if name == CACHE_CONFIG:
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if not all(part.isascii() and part.isdigit() and len(part) <= 20 for part in (blocks, size)):
            return None
        return float(int(blocks) * int(size))
    return value if math.isfinite(value) else None


def parse_engine_metrics(text: str) -> dict[str | None, EngineMetrics]:
    """Per model label (None = unlabelled) engine numbers from Prometheus text."""
    out: dict[str | None, EngineMetrics] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in KNOWN:
                continue
            value = _sample_value(sample.name, sample.labels, sample.value)
            if value is None:
                continue
            model = next((sample.labels[k] for k in MODEL_LABELS if k in sample.labels), None)
            out.setdefault(model, EngineMetrics()).add(sample.name, value)
    return out


def apply_engine_metrics(hub: StatsHub, parsed: dict[str | None, EngineMetrics]) -> int:
    """Feed parsed numbers to the hub; returns how many models were updated."""
    updated = 0
    unlabelled = parsed.get(None)
    for model in hub.registry.model_ids():
        specific = parsed.get(model)
        if specific is None and unlabelled is None:
            continue
        m = specific or EngineMetrics()
        if unlabelled is not None:
            m = m.fill_from(unlabelled)
        running, waiting = m.running, m.waiting
        if running is not None or waiting is not None:
            hub.on_engine_load(model, EngineLoad(running or 0, waiting or 0))
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
    link = LinkLog(log, "engine metrics polling", f"engine at {url}")
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=max(interval_s, 1.0))) as resp:
                if 200 <= resp.status < 300:
                    parsed = parse_engine_metrics(await resp.text())
                    apply_engine_metrics(hub, parsed)
                    if parsed:
                        link.connected()
                    else:
                        link.failed("the page has none of vLLM's or SGLang's load series", interval_s)
                else:
                    link.failed(f"HTTP {resp.status}", interval_s)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            link.failed(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, interval_s)
        await sleep(interval_s)
