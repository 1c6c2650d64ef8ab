"""Small builders shared by Pylon unit tests."""

from __future__ import annotations

from dataclasses import dataclass

from stargate.pylon.ids import RequestIds
from stargate.pylon.load import LiveLoad
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.models import Generation, ModelRegistry
from stargate.pylon.stats.hub import StatsHub
from stargate.wire.clock import ManualClock


@dataclass
class Rig:
    hub: StatsHub
    registry: ModelRegistry
    load: LiveLoad
    clock: ManualClock
    gen: Generation


def make_rig(
    *,
    model: str = "llama",
    initial_input_tps: float | None = None,
    pin: bool = False,
    limit: int | None = None,
    fallback: bool = False,
    floor_s: float = 0.010,
    prefix_caching: bool = False,
) -> Rig:
    registry = ModelRegistry()
    clock = ManualClock()
    load = LiveLoad(prefix_caching=prefix_caching, clock=clock.monotonic)
    hub = StatsHub(
        registry=registry,
        load=load,
        clock=clock,
        ids=RequestIds("11111111-2222-3333-4444-555555555555"),
        metrics=PylonMetrics(),
        initial_input_tps=initial_input_tps,
        pin_input_tps=pin,
        max_engine_concurrency=limit,
        fallback_enabled=fallback,
        floor_s=floor_s,
    )
    gen = registry.allocate(model)
    hub.init_generation(gen)
    registry.publish(gen)
    return Rig(hub, registry, load, clock, gen)
