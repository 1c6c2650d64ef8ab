"""The stats collector: every stats input meets here and ``snapshot`` builds the published
``ModelStats`` of one generation (spec pylon.md §6.3-§6.8).

Inputs are applied synchronously on the event loop (no channel), so the queue table and the
throughput state are always consistent when a heartbeat reads them. Data for a generation that
is no longer current is dropped.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from stargate.balancer.types import EMPTY_PRIORITY_MAP, AffinityRoute, ModelStats
from stargate.pylon.ids import RequestIds
from stargate.pylon.load import EngineExcess, EngineLoad, LiveLoad
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.models import Generation, ModelRegistry
from stargate.pylon.stats import aggregate as agg
from stargate.pylon.stats.counters import CounterTracker, Outcome
from stargate.pylon.stats.ndjson import PingEvent, StatsEvent
from stargate.pylon.stats.observation import Endpoint, Observation, State
from stargate.wire.clock import Clock
from stargate.wire.limits import remember_newest, sat_u64
from stargate.wire.proto import CACHED_PROMPT_WORK, MAX_AFFINITY_KEY_CHARS, MAX_AFFINITY_ROUTES

MAX_ENGINE_LIMITS = 4096
"""Models whose engine-reported limit is kept for generations to come (the oldest report goes)."""
MAX_PREFILL_TIMES = 200_000
"""Requests in output generation whose prefill time is kept for their input sample (the oldest goes)."""


class LimitSource(StrEnum):
    FALLBACK = "fallback"
    ENGINE = "engine"


@dataclass(frozen=True, slots=True)
class ConcurrencyUpdate:
    """The one update type for concurrency limits (engine reports and the CLI fallback).

    ENGINE value > 0 overrides, ENGINE 0 withdraws the override; FALLBACK sets the fallback.
    """

    generation: Generation
    source: LimitSource
    value: int


@dataclass(slots=True)
class _GenState:
    throughput: agg.ThroughputAggregate
    kv: tuple[int, int, int] | None = None
    kv_source: str = ""
    engine_limit: int = 0
    fallback_limit: int = 0
    engine_load: EngineExcess | None = None
    observed_at_ms: int = 0
    last_first_output_at: float | None = None
    usage_counted: set[str] = field(default_factory=set)
    routes: deque[AffinityRoute] = field(default_factory=lambda: deque(maxlen=MAX_AFFINITY_ROUTES))

    @property
    def effective_limit(self) -> int:
        return self.engine_limit if self.engine_limit > 0 else self.fallback_limit


class StatsHub:
    def __init__(
        self,
        *,
        registry: ModelRegistry,
        load: LiveLoad,
        clock: Clock,
        ids: RequestIds,
        metrics: PylonMetrics,
        initial_input_tps: float | None = None,
        pin_input_tps: bool = False,
        max_engine_concurrency: int | None = None,
        fallback_enabled: bool = False,
        floor_s: float = agg.DURATION_FLOOR_S,
        route_window_ms: int = 2000,
    ) -> None:
        self.registry = registry
        self.load = load
        self.clock = clock
        self.ids = ids
        self.metrics = metrics
        self.fallback_enabled = fallback_enabled
        self._initial_tps = initial_input_tps
        self._pin = pin_input_tps
        self._fallback_limit = max_engine_concurrency or 0
        self._route_window_ms = route_window_ms
        self._gens: dict[Generation, _GenState] = {}
        self._engine_limits: OrderedDict[str, int] = OrderedDict()  # model -> last report, newest last
        self._prefill_s: OrderedDict[str, float] = OrderedDict()  # request -> its prefill's seconds
        self._counters = CounterTracker(floor_s)
        self.on_change: Callable[[], None] = lambda: None
        load.on_change = self.on_load_change

    # -- generation lifecycle -------------------------------------------------------------
    def init_generation(self, gen: Generation, *, calibrating: bool = False) -> None:
        tps = None if calibrating else self._initial_tps
        self._gens[gen] = _GenState(agg.ThroughputAggregate.create(tps, self._pin and not calibrating))
        self._gens[gen].observed_at_ms = self.clock.wall_ms()
        self.apply_concurrency(ConcurrencyUpdate(gen, LimitSource.FALLBACK, self._fallback_limit))
        engine_limit = self._engine_limits.get(gen.model_id, 0)
        if engine_limit > 0:
            self.apply_concurrency(ConcurrencyUpdate(gen, LimitSource.ENGINE, engine_limit))

    def retire_generation(self, gen: Generation) -> None:
        self._gens.pop(gen, None)
        self.load.purge_generation(gen)
        self._counters.purge_generation(gen)
        self.metrics.remove_model(gen.model_id)

    def _state(self, gen: Generation) -> _GenState | None:
        return self._gens.get(gen) if self.registry.is_current(gen) else None

    def _touch(self, state: _GenState, source: str, reason: str) -> None:
        state.observed_at_ms = self.clock.wall_ms()
        self.metrics.snapshot_dirty(source, reason)

    @property
    def counter_source(self) -> str:
        """Where per-request counters come from: chunk usage in fallback mode, else the engine stream."""
        return agg.SRC_CHUNK_USAGE if self.fallback_enabled else agg.SRC_ENGINE_STREAM

    def counter_entries(self) -> int:
        return self._counters.live_count()

    def model_states(self) -> int:
        return len(self._gens)

    # -- concurrency limit ([PR] §6.8) ----------------------------------------------------
    def apply_concurrency(self, update: ConcurrencyUpdate) -> bool:
        """Apply a limit; a new effective limit is published promptly (``on_change``): routers
        read an unknown one as unlimited."""
        state = self._state(update.generation)
        if state is None:
            return False
        before = state.effective_limit
        if update.source is LimitSource.FALLBACK:
            state.fallback_limit = update.value
        else:
            state.engine_limit = update.value
        self._touch(state, str(update.source), "concurrency_limit")
        if state.effective_limit != before:
            self.on_change()
        return True

    # -- engine stats stream ----------------------------------------------------------------
    def on_ping(self, ping: PingEvent) -> None:
        """An engine's limit applies to the model's generation now and to the ones to come: the
        ping sent when the stream connects comes before Pylon's first generation, and dropping it
        published no limit until the next ping (``unknown``, which a router reads as unlimited:
        every request it held went to the new engine at once)."""
        if ping.model is None or ping.max_engine_concurrency is None:
            return
        remember_newest(self._engine_limits, ping.model, ping.max_engine_concurrency, MAX_ENGINE_LIMITS)
        gen = self.registry.current(ping.model)
        if gen is not None:
            self.apply_concurrency(ConcurrencyUpdate(gen, LimitSource.ENGINE, ping.max_engine_concurrency))

    def _owner(self, request_id: str) -> Generation | None:
        """None for Pylon's own calibration and canary requests: a canary's 4-token prompt and
        capped answer measure the engine's fixed costs, not its rates (an idle fleet's canaries
        took a published input rate from 5 000 to 1 610 tokens/s)."""
        if self.ids.parse(request_id) is not None:
            return None
        return self.load.generation_of(request_id) or self._counters.owner(request_id)

    def on_engine_stats(self, event: StatsEvent) -> str | None:
        """Apply one stream event; returns an aggregator invalid reason, if any."""
        gen = self._owner(event.request_id)
        state = self._state(gen) if gen is not None else None
        if gen is None or state is None:
            return None
        now = self.clock.monotonic()
        result = self._counters.apply(
            event.request_id,
            gen,
            tokens_processed=event.tokens_processed,
            tokens_generated=event.tokens_generated,
            finished=event.finished,
            now=now,
        )
        if result.outcome is not Outcome.APPLIED:
            return str(result.outcome)
        tp = state.throughput
        if agg.CAP_ENGINE_STREAM not in tp.labels:
            tp.add_labels(agg.CAP_ENGINE_STREAM, agg.SRC_ENGINE_STREAM)
        if result.input_sample is not None:
            units, duration = result.input_sample
            share = result.prefill_share
            tp.add_input_sample(units * share, duration, cached=share < 1.0)
        if result.output_sample is not None:
            units, duration = result.output_sample
            tp.add_output_sample(units / duration, from_counters=True)
        tp.last_counter_event_at = now
        self._touch(state, agg.SRC_ENGINE_STREAM, "counter_event")
        return None

    # -- request observations (fallback math, §6.4) -----------------------------------------
    def on_admitted(self, gen: Generation, cache_affinity_key: str | None, input_tokens: int) -> None:
        """A request was admitted: with a cache-affinity key (as the router reads the header:
        ``text_value``), the next heartbeats publish where it went."""
        state = self._gens.get(gen)
        if state is None or not cache_affinity_key or len(cache_affinity_key) > MAX_AFFINITY_KEY_CHARS:
            return
        state.routes.append(AffinityRoute(cache_affinity_key, input_tokens, self.clock.wall_ms()))

    def on_request_tracked(self, request_id: str, gen: Generation) -> None:
        """``request_id`` is tracked in ``load``: its input samples count the share of its prompt
        counted there as work (the engine's ``tokens_processed`` counts a cached prefix too)."""
        share = self.load.prefill_share(request_id)
        self._counters.observe(request_id, gen, self.clock.monotonic(), share)

    def _prefilled(self, obs: Observation) -> tuple[float, bool]:
        """The prompt tokens the engine prefilled for ``obs``, and whether it had part of the prompt
        cached. Input samples count this work, as ``queued_input_size`` does: counting a cached
        prefix over the time the rest took published 3x the engine's rate. The engine's own cached
        count wins; else the share Pylon counted (``--engine-prefix-caching``); else every token."""
        learnable = obs.learnable_input_tokens
        uncached = obs.uncached_input_tokens
        if uncached is not None:
            return uncached, uncached < learnable
        share = self._counters.prefill_share(obs.request_id, obs.generation)
        return learnable * share, share < 1.0

    def on_usage(self, request_id: str, gen: Generation, completion_tokens: int) -> None:
        """A streamed explicit cumulative output counter (chunk usage), used in fallback mode."""
        state = self._state(gen)
        if state is None or not self.fallback_enabled:
            return
        now = self.clock.monotonic()
        result = self._counters.apply(
            request_id,
            gen,
            tokens_processed=None,
            tokens_generated=completion_tokens,
            finished=False,
            now=now,
        )
        if result.outcome is Outcome.APPLIED and result.output_sample is not None:
            units, duration = result.output_sample
            state.throughput.add_output_sample(units / duration, from_counters=True)
            state.usage_counted.add(request_id)
        state.throughput.last_counter_event_at = now
        self._touch(state, agg.SRC_CHUNK_USAGE, "counter_event")

    def _first_output(self, state: _GenState, obs: Observation) -> None:
        """Time the prefill of ``obs``'s prompt, whose first output is now. An engine prefills
        prompts one after another: this one started when it was sent or when the one before it
        ended (its first output), whichever is later. Its time to first output counted the wait
        behind the prompts before it: a 10 000 tokens/s engine published 1 500 at 16 in flight."""
        if obs.request_id in self._prefill_s:
            return  # a progress observation: the first output was earlier
        now = self.clock.monotonic()
        sent_at = now - obs.elapsed
        last = state.last_first_output_at
        start = sent_at if last is None else max(sent_at, last)
        remember_newest(self._prefill_s, obs.request_id, now - start, MAX_PREFILL_TIMES)
        state.last_first_output_at = now

    def on_observation(self, obs: Observation) -> None:
        prefill_s = None
        if obs.state.terminal:
            self._counters.end(obs.request_id, obs.generation, self.clock.monotonic())
            prefill_s = self._prefill_s.pop(obs.request_id, None)
        state = self._state(obs.generation)
        if state is None:
            return
        tp = state.throughput
        if obs.output_tokens_from_chunk_usage and agg.CAP_CHUNK_USAGE not in tp.labels:
            tp.add_labels(agg.CAP_CHUNK_USAGE, agg.SRC_CHUNK_USAGE)
        fallback = self.fallback_enabled or obs.calibration
        if not obs.state.terminal:
            if (
                self.fallback_enabled
                and obs.state is State.OUTPUT_GENERATION
                and obs.endpoint != Endpoint.EMBEDDINGS
            ):
                if obs.streamed and not obs.calibration:  # a JSON answer's first output is its end
                    self._first_output(state, obs)
                rate = agg.decode_rate(
                    obs.output_tokens, obs.time_to_first_token, obs.time_to_first_output, obs.elapsed
                )
                tp.set_live_rate(obs.request_id, rate)
            return
        tp.set_live_rate(obs.request_id, None)
        counted = obs.request_id in state.usage_counted
        state.usage_counted.discard(obs.request_id)
        if obs.state is State.COMPLETE and obs.embedding_items is not None:
            tp.add_embedding_sample(obs.embedding_items, obs.elapsed - (obs.time_to_response_headers or 0.0))
        if obs.state is State.COMPLETE and fallback:
            prefilled, cached = self._prefilled(obs)
            if obs.endpoint is Endpoint.EMBEDDINGS:
                base = obs.time_to_response_headers or obs.elapsed
                tp.add_input_sample(prefilled, max(base, agg.DURATION_FLOOR_S), cached=cached)
            elif obs.streamed:  # a JSON answer's times include the decode: no TTFO, no rate
                ttfo = obs.time_to_first_output if prefill_s is None else prefill_s
                sample = agg.fallback_input_tps(prefilled, ttfo)
                if sample is not None:
                    tp.add_input_sample(*sample, cached=cached)
                if self.fallback_enabled and not counted:
                    rate = agg.decode_rate(
                        obs.output_tokens, obs.time_to_first_token, obs.time_to_first_output, obs.elapsed
                    )
                    if rate is not None:
                        tp.add_output_sample(rate, from_counters=False)
        self._touch(state, "request_observation", "request_finished")

    # -- KV and engine load ------------------------------------------------------------------
    def on_kv(self, model: str, capacity: int, used: int, free: int, *, source: str = agg.SRC_KV) -> bool:
        gen = self.registry.current(model.strip()) if model.strip() else None
        state = self._state(gen) if gen is not None else None
        if state is None:
            return False
        state.kv = (capacity, used, free)
        state.kv_source = source
        cap = agg.CAP_KV_HTTP if source == agg.SRC_KV else agg.CAP_PROMETHEUS
        state.throughput.add_labels(cap, source)
        self._touch(state, source, "kv_cache")
        return True

    def drop_kv(self, model: str, *, source: str) -> None:
        """The KV numbers ``source`` last gave ``model`` are no longer known (another source's
        stay): an engine whose metrics page broke while its cache was full looked full for good."""
        gen = self.registry.current(model)
        state = self._state(gen) if gen is not None else None
        if state is None or state.kv is None or state.kv_source != source:
            return
        state.kv = None
        self._touch(state, source, "kv_cache")

    def on_engine_load(self, model: str, load: EngineLoad | None) -> bool:
        """The engine's own count of ``model``'s requests; None: no longer known (Pylon's own
        counts alone are published)."""
        gen = self.registry.current(model)
        state = self._state(gen) if gen is not None else None
        if gen is None or state is None:
            return False
        excess = None if load is None else load.beyond(self.load.snapshot(gen), self.load.own_requests(gen))
        changed = state.engine_load != excess
        state.engine_load = excess
        if load is None:
            if changed:
                self.on_change()
            return True
        state.throughput.add_labels(agg.CAP_PROMETHEUS, agg.SRC_PROMETHEUS)
        self._touch(state, agg.SRC_PROMETHEUS, "engine_load")
        if changed:
            self.on_change()
        return True

    def on_load_change(self, gen: Generation) -> None:
        """Pylon's own counts of ``gen`` changed: a change to publish promptly (``on_change``)."""
        state = self._gens.get(gen)
        if state is not None:
            self._touch(state, "request_observation", "load_change")
            self.on_change()

    # -- staleness ----------------------------------------------------------------------------
    def sweep(self) -> None:
        now = self.clock.monotonic()
        for _gen, state in self._gens.items():
            if state.throughput.sweep(now):
                self.metrics.stale_cleanups.labels(kind="stats").inc()
                self._touch(state, "sweep", "stale")
        finalized = self._counters.sweep(now)
        if finalized:
            self.metrics.stale_cleanups.labels(kind="request").inc(finalized)

    # -- publication ----------------------------------------------------------------------------
    def input_tps(self, gen: Generation) -> float:
        state = self._gens.get(gen)
        return state.throughput.published_input_tps if state is not None else 0.0

    def embedding_item_tps(self, gen: Generation) -> tuple[float, float]:
        """``(embedding_item_tps, max_embedding_item_tps)`` for Pylon's own gauges."""
        state = self._gens.get(gen)
        if state is None:
            return 0.0, 0.0
        return state.throughput.embedding_item_tps, state.throughput.max_embedding_item_tps

    def effective_limit(self, gen: Generation) -> int:
        state = self._gens.get(gen)
        return state.effective_limit if state is not None else 0

    def snapshot(self, gen: Generation) -> ModelStats:
        state = self._gens.get(gen)
        if state is None:
            return ModelStats()
        tp = state.throughput
        live = self.load.snapshot(gen)
        estimates = self.load.estimates(gen, tp.published_input_tps)
        kv = state.kv or (0, 0, 0)
        if state.engine_load is not None:
            live = state.engine_load.add_to(live)
        caps, srcs = tp.ordered_labels()
        if self.load.prefix_caching:
            caps = (*caps, CACHED_PROMPT_WORK)
        routes = state.routes
        oldest = self.clock.wall_ms() - self._route_window_ms
        while routes and routes[0].admitted_at_unix_ms < oldest:
            routes.popleft()
        return ModelStats(
            last_mean_input_tps=tp.published_input_tps,
            output_tps=tp.output_tps,
            queue_size=live.queue_size,
            queued_input_size=live.queued_input_size,
            max_output_tps=tp.max_output_tps,
            kv_cache_capacity_tokens=sat_u64(kv[0]),
            kv_cache_used_tokens=sat_u64(kv[1]),
            kv_cache_free_tokens=sat_u64(kv[2]),
            num_running_queries=live.num_running_queries,
            max_engine_concurrency=sat_u64(state.effective_limit),
            total_query_input_size=live.total_query_input_size,
            queue_time_estimate_ms_by_priority=MappingProxyType(estimates)
            if estimates
            else EMPTY_PRIORITY_MAP,
            input_processing_queries=live.input_processing_queries,
            output_generation_queries=live.output_generation_queries,
            stats_observed_at_unix_ms=state.observed_at_ms,
            stats_capabilities=caps,
            stats_sources=srcs,
            recent_cache_affinity_routes=tuple(routes),
            prefilling_cache_affinity_keys=live.prefilling_keys,
        )
