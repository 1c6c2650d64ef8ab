"""What a late canary is measured against: when the engine last produced output (``Relay``)."""

from __future__ import annotations

import aiohttp

from stargate.pylon.config import parse_settings
from stargate.pylon.health import HealthProber
from stargate.pylon.metrics import PylonMetrics
from stargate.pylon.observer import PROGRESS_INTERVAL_S
from stargate.pylon.relay import Relay
from stargate.pylon.stats.observation import Endpoint, Observation, State

from .helpers import make_rig

ENGINE = "http://127.0.0.1:9"


async def test_a_decoding_answer_counts_as_output_for_its_progress_interval() -> None:
    # A streamed answer reports its tokens once per progress interval: a canary whose timeout is
    # shorter than that, queued behind it, must still find the engine producing.
    rig = make_rig()
    settings = parse_settings(["--upstream-http-base-url", ENGINE, "--model-name", "llama"])
    async with aiohttp.ClientSession() as session:
        relay = Relay(
            settings=settings, session=session, registry=rig.registry, hub=rig.hub, load=rig.load,
            metrics=PylonMetrics(), clock=rig.clock, prober=HealthProber(session, ENGINE, ("/health",)),
        )  # fmt: skip
        assert not relay.produced_within("llama", 0.5)
        relay.record(Observation("r1", rig.gen, Endpoint.CHAT, State.OUTPUT_GENERATION, 10, 1))
        rig.clock.advance(0.5 + PROGRESS_INTERVAL_S)  # still decoding; its next report is due now
        assert relay.produced_within("llama", 0.5)
        rig.clock.advance(0.1)
        assert not relay.produced_within("llama", 0.5)
