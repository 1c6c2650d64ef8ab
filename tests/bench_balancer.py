"""Microbenchmark: microseconds per decision at 4, 64 and 512 clusters (run directly, not a test).

.venv/bin/python tests/bench_balancer.py
"""

from __future__ import annotations

import dataclasses
import random
import timeit
from types import MappingProxyType

from stargate.balancer import (
    Algorithm,
    AlgorithmDefinition,
    Candidate,
    Comparator,
    LbRequest,
    ModelStats,
    Target,
    build_policy,
)
from stargate.balancer.config import load_lb_config
from stargate.balancer.types import InFlight
from stargate.bench.peers.compare import RECOMMENDED_FILE

RECOMMENDED = load_lb_config(str(RECOMMENDED_FILE)).resolve("llama", None)
"""The shipped file; with the settings for streaming clients (docs/configuration.md) below it."""

DEFINITIONS = {
    "power-of-n (k=2, ttft)": AlgorithmDefinition(Algorithm.POWER_OF_N, comparator=Comparator.TTFT),
    "round-robin": AlgorithmDefinition(Algorithm.ROUND_ROBIN),
    "random": AlgorithmDefinition(Algorithm.RANDOM),
    "wait-and-widen (ttft)": AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN, comparator=Comparator.TTFT),
    "wait-and-widen affinity (X=200)": AlgorithmDefinition(
        Algorithm.WAIT_AND_WIDEN, comparator=Comparator.TTFT, selection_count=2, cache_affinity_wait_ms=200
    ),
    "power-of-n load-aware": AlgorithmDefinition(
        Algorithm.POWER_OF_N, comparator=Comparator.TTFT, load_aware=True
    ),
    "wait-and-widen load-aware": AlgorithmDefinition(
        Algorithm.WAIT_AND_WIDEN, comparator=Comparator.TTFT, load_aware=True
    ),
    "recommended.json": RECOMMENDED,
    "recommended.json + yield, await": dataclasses.replace(
        RECOMMENDED, cache_affinity_yield_margin_ms=1000, cache_affinity_await_prefill=True
    ),
    "recommended.json + yield, await, sharing": dataclasses.replace(
        RECOMMENDED,
        cache_affinity_yield_margin_ms=1000,
        cache_affinity_await_prefill=True,
        prefill_sharing=True,
    ),
    "pulsar": AlgorithmDefinition(Algorithm.PULSAR),
    "pulsar-wait-and-widen (slo)": AlgorithmDefinition(
        Algorithm.PULSAR_WAIT_AND_WIDEN, queue_slo_ms=(50, 500)
    ),
}


def make_candidates(count: int, generator: random.Random) -> tuple[Candidate, ...]:
    return tuple(
        Candidate(
            cluster_id=f"cluster-{i:04d}",
            stats=ModelStats(
                last_mean_input_tps=generator.uniform(500.0, 5000.0),
                queued_input_size=generator.randrange(0, 20_000),
                num_running_queries=generator.randrange(0, 40),
                max_engine_concurrency=32,
                queue_time_estimate_ms_by_priority=MappingProxyType({0: generator.randrange(0, 400)}),
            ),
            rtt_s=generator.uniform(0.001, 0.08),
        )
        for i in range(count)
    )


PREFILLING = ("recommended.json + yield, await", "recommended.json + yield, await, sharing")
"""Rows run again with this router's prompts prefilling on every cluster: the estimates that read
each prompt's size (``prefill_sharing``) cost more there than on idle clusters."""


def with_prefilling(
    candidates: tuple[Candidate, ...], count: int, generator: random.Random
) -> tuple[Candidate, ...]:
    def in_flight() -> InFlight:
        sizes = tuple(sorted(generator.randrange(100, 20_000) for _ in range(count)))
        return InFlight(count, count, sum(sizes), prefill_sizes=sizes)

    return tuple(dataclasses.replace(candidate, in_flight=in_flight()) for candidate in candidates)


def main() -> None:
    generator = random.Random(1)
    request = LbRequest(Target(None, "model"), 1000, received_at=0.0, now=0.03, cache_affinity_key="prefix-7")
    print(f"{'algorithm':56s}" + "".join(f"{n:>10d}" for n in (4, 64, 512)) + "   (µs per decision)")
    rows = [(name, definition, 0) for name, definition in DEFINITIONS.items()]
    rows += [(f"{name}, 16 prefilling", DEFINITIONS[name], 16) for name in PREFILLING]
    for name, definition, prefilling in rows:
        row = []
        for count in (4, 64, 512):
            candidates = make_candidates(count, generator)
            if prefilling:
                candidates = with_prefilling(candidates, prefilling, generator)
            policy = build_policy(definition)
            policy.decide(candidates, request, generator)  # build rings and caches outside the timing
            loops = max(200, 40_000 // count)
            seconds = min(
                timeit.repeat(lambda: policy.decide(candidates, request, generator), number=loops, repeat=3)  # noqa: B023
            )
            row.append(seconds / loops * 1e6)
        print(f"{name:56s}" + "".join(f"{value:10.2f}" for value in row))


if __name__ == "__main__":
    main()
