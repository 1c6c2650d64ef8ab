"""Engine stats from a stock vLLM or SGLang Prometheus ``/metrics`` endpoint.

With ``--engine-stats-source prometheus`` Pylon works in front of an unmodified engine: the
engine's running/waiting counts and KV occupancy are polled on an interval; throughput comes
from OpenAI chunk usage (fallback math). Series carrying a ``model_name`` (or older SGLang's
``name``) label update that model; unlabelled series update every current model.

One quantity may be exported under several names (vLLM's and SGLang's, old and new): the
series of one name are summed (data-parallel ranks each export their own), and the names of one
quantity are never added together — the largest wins. An engine that exports both families (the
mock engine does) is therefore counted once. A series is counted once however often the page
repeats it, and of SGLang's tensor-parallel ranks (``tp_rank``, all exporting with
``--enable-metrics-for-all-schedulers``) only rank 0: they report one shared batch. A page that
cannot be had, or that carries none of these series for a served model (a wrong
``--engine-metrics-path``, another engine, a ``model_name`` other than ``--model-name``), is
logged once until it is.

The engine's report is trusted only while it is fresh: a served model without running or waiting
series on a page (its own or unlabelled ones, with a finite value) loses it at once, and every
model loses it after ``STALE_AFTER_FAILURES`` polls in a row that failed (an engine report of 57
requests, left from before its page broke, kept an idle engine out of routing). Only the lines of
the series read here are parsed, off the event loop, from a page of at most ``MAX_PAGE_BYTES``:
parsing all of a 10 MB page took 4 s of the loop every poll, and one malformed or absurd line
ended the poller, and with it Pylon.
"""

from __future__ import annotations

import asyncio
import codecs
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
_KNOWN_PREFIXES = tuple(KNOWN)
MODEL_LABELS = ("model_name", "name")
MAX_PAGE_BYTES = 16 * 1024 * 1024
STALE_AFTER_FAILURES = 3
MIN_POLL_TIMEOUT_S = 3.0
"""A poll may take this long at least, whatever the interval: a busy engine's page (many
histogram series) can take over a second, and a timeout at the 1 s interval never read it."""
POLL_FAILURE_REASONS = ("http_status", "timeout", "connection", "too_large", "unreadable", "no_load_series")
"""``reason`` of ``pylon_engine_metrics_poll_failures_total``, each counted from 0."""


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
    try:
        number = float(value)  # the parser gives an int for digits, of any length
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _known_lines(text: str) -> list[str]:
    """The sample lines of the series read here (comments, other series and their labels skipped)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(_KNOWN_PREFIXES) and line.split("{", 1)[0].split(None, 1)[0] in KNOWN
    ]


def parse_engine_metrics(text: str) -> dict[str | None, EngineMetrics]:
    """Per model label (None = unlabelled) engine numbers from Prometheus text; a line the
    parser refuses is skipped."""
    out: dict[str | None, EngineMetrics] = {}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for line in _known_lines(text):
        try:
            samples = [s for family in text_string_to_metric_families(line) for s in family.samples]
        except (ValueError, IndexError, KeyError, TypeError, OverflowError):
            continue
        for sample in samples:
            if sample.name not in KNOWN or sample.labels.get("tp_rank", "0") != "0":
                continue
            value = _sample_value(sample.name, sample.labels, sample.value)
            series = (sample.name, frozenset(sample.labels.items()))
            if value is None or series in seen:
                continue
            seen.add(series)
            model = next((sample.labels[k] for k in MODEL_LABELS if k in sample.labels), None)
            out.setdefault(model, EngineMetrics()).add(sample.name, value)
    return out


def apply_engine_metrics(hub: StatsHub, parsed: dict[str | None, EngineMetrics]) -> int:
    """Feed parsed numbers to the hub; returns how many models got the engine's load. A served
    model without running or waiting series of its own (or unlabelled ones) loses the engine's
    last report: vLLM's ``cache_config_info`` carries no ``model_name``, and counting it as the
    model's data kept an engine load of 40 published for an engine since renamed and idle."""
    updated = 0
    unlabelled = parsed.get(None)
    for model in hub.registry.model_ids():
        m = parsed.get(model) or EngineMetrics()
        if unlabelled is not None:
            m = m.fill_from(unlabelled)
        kv = m.kv
        if kv is None:
            hub.drop_kv(model, source=SRC_PROMETHEUS)
        else:
            hub.on_kv(model, *kv, source=SRC_PROMETHEUS)
        running, waiting = m.running, m.waiting
        if running is None and waiting is None:
            hub.on_engine_load(model, None)
        else:
            hub.on_engine_load(model, EngineLoad(running or 0, waiting or 0))
            updated += 1
    return updated


def forget_engine_report(hub: StatsHub) -> None:
    """Every served model loses the engine's load and the KV numbers the page gave."""
    for model in hub.registry.model_ids():
        hub.drop_kv(model, source=SRC_PROMETHEUS)
        hub.on_engine_load(model, None)


async def run_prometheus_poller(
    session: aiohttp.ClientSession,
    url: str,
    hub: StatsHub,
    *,
    interval_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    link = LinkLog(log, "engine metrics polling", f"engine at {url}")
    counter = hub.metrics.engine_metrics_poll_failures
    for reason in POLL_FAILURE_REASONS:
        counter.labels(reason)
    failures = 0
    while True:
        if not hub.registry.model_ids():
            # Before the first model is registered (Pylon waits for the engine's health first) a
            # page has no model to update: it was logged as one for a model Pylon does not serve.
            await sleep(interval_s)
            continue
        failure = await _poll(session, url, hub, interval_s)
        if failure is None:
            failures = 0
            link.connected()
        else:
            reason, problem = failure
            counter.labels(reason).inc()
            link.failed(problem, interval_s)
            failures += 1
            if failures == STALE_AFTER_FAILURES:
                forget_engine_report(hub)
        await sleep(interval_s)


async def _poll(
    session: aiohttp.ClientSession, url: str, hub: StatsHub, interval_s: float
) -> tuple[str, str] | None:
    """One poll applied to the hub; what went wrong (a ``POLL_FAILURE_REASONS`` and a message for
    the log), or None."""
    too_large = ("too_large", f"the page is larger than {MAX_PAGE_BYTES} bytes")
    try:
        timeout = aiohttp.ClientTimeout(total=max(interval_s, MIN_POLL_TIMEOUT_S))
        async with session.get(url, timeout=timeout) as resp:
            if not 200 <= resp.status < 300:
                return "http_status", f"HTTP {resp.status}"
            coding = resp.headers.get("Content-Encoding", "identity").strip().lower()
            if coding != "identity":
                return (
                    "unreadable",
                    f"the page came compressed (Content-Encoding: {coding}) though Pylon asked for none",
                )
            if (resp.content_length or 0) > MAX_PAGE_BYTES:
                return too_large
            body = bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                if len(body) > MAX_PAGE_BYTES:
                    return too_large
            text = body.decode(_charset(resp.charset), errors="replace")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        if isinstance(exc, TimeoutError):
            reason = "timeout"
        elif isinstance(exc, aiohttp.ClientConnectionError):
            reason = "connection"
        else:
            reason = "unreadable"
        return reason, (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    parsed = await asyncio.to_thread(parse_engine_metrics, text)
    if not parsed:
        return "no_load_series", "the page has none of vLLM's or SGLang's load series"
    if apply_engine_metrics(hub, parsed) == 0:
        served = hub.registry.model_ids()
        labels = sorted(m for m in parsed if m is not None and m not in served)[:5]
        if labels:
            return "no_load_series", (
                f"the page's series are for model_name {', '.join(labels)}, not a model Pylon serves"
            )
        return "no_load_series", (
            f"the page has no finite running or waiting count for model_name {', '.join(served[:5])}"
        )
    return None


def _charset(declared: str | None) -> str:
    try:
        return codecs.lookup(declared).name if declared else "utf-8"
    except LookupError:
        return "utf-8"
