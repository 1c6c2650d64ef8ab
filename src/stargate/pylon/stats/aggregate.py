"""Per-generation throughput aggregate and the metric formulas of spec pylon.md §6.4.

- ``last_mean_input_tps``: all-time running (Welford) mean of input samples, published once the
  distribution holds ≥ 5 samples (a bootstrap counts as 5); sticky, never cleared by staleness.
- ``output_tps`` = max(A, W): W is the mean of the last ≤ 8 output samples, A the mean live
  decode rate of requests in output generation (fallback only, ignored once counters are
  authoritative for the model).
- ``max_output_tps``: the largest output sample ever.
- embeddings item TPS: mean of the last ≤ 8 samples ``items / max(total - headers, 10 ms)`` and
  its maximum; Pylon's own gauges only, never published to Stargate.

Plausibility (not in the original, which let one absurd ``x-input-tokens`` poison the all-time
input mean forever): a throughput sample is discarded when it counts more than
``MAX_PLAUSIBLE_TOKENS`` units or its rate exceeds ``MAX_PLAUSIBLE_TPS``. Such numbers come from a
client claim or a faulty engine counter, never from a real engine, and carry no information.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from stargate.wire.limits import MAX_PLAUSIBLE_TOKENS, MAX_PLAUSIBLE_TPS

DURATION_FLOOR_S = 0.010
OUTPUT_WINDOW = 8
READY_SAMPLES = 5
OUTPUT_TTL_S = 30.0

CAP_CHUNK_USAGE = "request.output.chunk_usage"
CAP_ENGINE_STREAM = "model.throughput.engine_stream"
CAP_KV_HTTP = "machine.kv_cache.http"
CAP_PROMETHEUS = "machine.engine.prometheus"
SRC_CHUNK_USAGE = "chunk_usage"
SRC_ENGINE_STREAM = "engine_stats_stream"
SRC_KV = "kv_cache_stats"
SRC_PROMETHEUS = "engine_prometheus"

LABEL_ORDER = (
    (CAP_CHUNK_USAGE, SRC_CHUNK_USAGE),
    (CAP_ENGINE_STREAM, SRC_ENGINE_STREAM),
    (CAP_KV_HTTP, SRC_KV),
    (CAP_PROMETHEUS, SRC_PROMETHEUS),
)


@dataclass(slots=True)
class InputDistribution:
    count: int = 0
    mean: float = 0.0

    def bootstrap(self, tps: float) -> None:
        self.count = READY_SAMPLES
        self.mean = tps

    def add(self, tps: float) -> None:
        self.count += 1
        self.mean += (tps - self.mean) / self.count


@dataclass(slots=True)
class ThroughputAggregate:
    """Throughput state of one model generation; all times are monotonic seconds."""

    pinned_input_tps: float | None = None
    input: InputDistribution = field(default_factory=InputDistribution)
    published_input_tps: float = 0.0
    output_window: deque[float] = field(default_factory=lambda: deque(maxlen=OUTPUT_WINDOW))
    max_output_tps: float = 0.0
    counter_authoritative: bool = False
    last_counter_event_at: float | None = None
    live_decode_rates: dict[str, float] = field(default_factory=dict)
    labels: set[str] = field(default_factory=set)
    embedding_window: deque[float] = field(default_factory=lambda: deque(maxlen=OUTPUT_WINDOW))
    max_embedding_item_tps: float = 0.0

    @classmethod
    def create(cls, initial_input_tps: float | None, pinned: bool) -> ThroughputAggregate:
        agg = cls(pinned_input_tps=initial_input_tps if pinned else None)
        if initial_input_tps is not None:
            agg.input.bootstrap(initial_input_tps)
            agg._refresh_input()
        return agg

    def add_input_sample(self, units: float, duration_s: float, *, cached: bool = False) -> None:
        """``cached``: the units are what the engine prefilled of a prompt whose prefix it had
        cached. Such a sample counts only if its work takes the duration floor at the mean rate so
        far: a request's time is then mostly the engine's fixed cost (a step, the first token), and
        a fully cached prompt's last token over a 20 ms step is 50 tokens/s."""
        if units < 1 or duration_s < DURATION_FLOOR_S - 1e-9 or not plausible(units, units / duration_s):
            return
        if cached and units < self.input.mean * DURATION_FLOOR_S:
            return
        self.input.add(units / duration_s)
        self._refresh_input()

    def _refresh_input(self) -> None:
        if self.pinned_input_tps is not None:
            self.published_input_tps = self.pinned_input_tps
            return
        mean = self.input.mean
        if self.input.count >= READY_SAMPLES and math.isfinite(mean) and mean > 0:
            self.published_input_tps = mean

    def add_output_sample(self, tps: float, *, from_counters: bool) -> None:
        if not (math.isfinite(tps) and 0 < tps <= MAX_PLAUSIBLE_TPS):
            return
        self.output_window.append(tps)
        self.max_output_tps = max(self.max_output_tps, tps)
        if from_counters:
            self.counter_authoritative = True

    def add_embedding_sample(self, items: int, duration_s: float) -> None:
        if items < 1:
            return
        tps = items / max(duration_s, DURATION_FLOOR_S)
        self.embedding_window.append(tps)
        self.max_embedding_item_tps = max(self.max_embedding_item_tps, tps)

    @property
    def embedding_item_tps(self) -> float:
        window = self.embedding_window
        return sum(window) / len(window) if window else 0.0

    def set_live_rate(self, request_id: str, rate: float | None) -> None:
        if rate is None or not plausible(0, rate):
            self.live_decode_rates.pop(request_id, None)
        else:
            self.live_decode_rates[request_id] = rate

    @property
    def output_tps(self) -> float:
        window = sum(self.output_window) / len(self.output_window) if self.output_window else 0.0
        if self.counter_authoritative or not self.live_decode_rates:
            return window
        live = sum(self.live_decode_rates.values()) / len(self.live_decode_rates)
        return max(live, window)

    def sweep(self, now: float) -> bool:
        """Age out the output window after 30 s without counter events; True when it did."""
        if self.last_counter_event_at is None or now - self.last_counter_event_at < OUTPUT_TTL_S:
            return False
        self.output_window.clear()
        self.counter_authoritative = False
        self.last_counter_event_at = None
        return True

    def ordered_labels(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        caps = tuple(c for c, _ in LABEL_ORDER if c in self.labels)
        srcs = tuple(s for _, s in LABEL_ORDER if s in self.labels)
        return caps, srcs

    def add_labels(self, capability: str, source: str) -> None:
        self.labels.add(capability)
        self.labels.add(source)


def plausible(units: float, tps: float) -> bool:
    """A sample a real engine could have produced (see the module docstring)."""
    return units <= MAX_PLAUSIBLE_TOKENS and math.isfinite(tps) and tps <= MAX_PLAUSIBLE_TPS


def fallback_input_tps(input_tokens: float, ttfo_s: float | None) -> tuple[float, float] | None:
    """Chat/responses input sample ``(units, duration)`` from a complete observation; no clamp."""
    if ttfo_s is None or input_tokens < 1 or ttfo_s < DURATION_FLOOR_S:
        return None
    return input_tokens, ttfo_s


def decode_rate(
    output_tokens: int, ttft_s: float | None, ttfo_s: float | None, elapsed_s: float
) -> float | None:
    """``output_tokens / decode_duration``: after the first token if ≥ 10 ms, else after first output."""
    if output_tokens < 1:
        return None
    if ttft_s is not None and elapsed_s - ttft_s >= DURATION_FLOOR_S:
        return output_tokens / (elapsed_s - ttft_s)
    if ttfo_s is not None and elapsed_s - ttfo_s >= DURATION_FLOOR_S:
        return output_tokens / (elapsed_s - ttfo_s)
    return None
