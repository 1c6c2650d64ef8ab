"""Client and engine numbers are bounded where stats use them (issue: six streams claiming
``x-input-tokens: 18446744073709551615`` broke heartbeat building and poisoned the input TPS)."""

from __future__ import annotations

import pytest

from stargate.pylon.load import U64_MAX, Phase
from stargate.pylon.observer import SseScanner
from stargate.pylon.registration import stats_to_proto
from stargate.pylon.stats.ndjson import StatsEvent
from stargate.pylon.stats.observation import Endpoint, Observation, State
from stargate.wire.limits import MAX_PLAUSIBLE_TOKENS

from .helpers import Rig, make_rig


def complete(rig: Rig, rid: str, claimed: int, reported: int | None = None) -> None:
    rig.hub.on_observation(
        Observation(
            request_id=rid,
            generation=rig.gen,
            endpoint=Endpoint.CHAT,
            state=State.COMPLETE,
            input_tokens=claimed,
            output_tokens=1,
            time_to_first_output=0.5,
            elapsed=1.0,
            reported_input_tokens=reported,
        )
    )


def test_six_u64_max_claims_saturate_every_published_sum() -> None:
    rig = make_rig(initial_input_tps=5000)
    for i in range(6):
        rig.load.track(f"r{i}", rig.gen, 0, U64_MAX)
    rig.load.advance("r5", Phase.INPUT_PROCESSING)
    snap = rig.hub.snapshot(rig.gen)
    assert snap.total_query_input_size == U64_MAX and snap.queued_input_size == U64_MAX
    assert set(snap.queue_time_estimate_ms_by_priority.values()) == {U64_MAX}
    proto = stats_to_proto(snap)  # raised ValueError: Value out of range before
    assert proto.total_query_input_size == U64_MAX
    for i in range(6):  # exact sums underneath: releasing restores the true values
        rig.load.release(f"r{i}")
    rig.load.track("small", rig.gen, 0, 7)
    assert rig.hub.snapshot(rig.gen).total_query_input_size == 7


def test_absurd_claims_never_move_the_input_tps() -> None:
    rig = make_rig(initial_input_tps=5000, fallback=True)
    for i in range(6):
        complete(rig, f"r{i}", U64_MAX)
        complete(rig, f"big{i}", MAX_PLAUSIBLE_TOKENS + 1)
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == 5000


def test_engine_reported_prompt_tokens_bound_the_claim() -> None:
    rig = make_rig(initial_input_tps=100, fallback=True)
    complete(rig, "lying", U64_MAX, reported=100)  # 100 tokens over 0.5 s: 200 tok/s
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx((5 * 100 + 200) / 6)
    complete(rig, "template", 50, reported=80)  # the claim stands when the engine counts more
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx((5 * 100 + 200 + 100) / 7)


def test_absurd_engine_counters_are_no_throughput_sample() -> None:
    rig = make_rig(initial_input_tps=5000)
    rig.load.track("r", rig.gen, 0, 10)
    rig.hub.on_engine_stats(StatsEvent("r", rig.gen.model_id, 0, 0, False))
    rig.clock.advance(0.1)
    rig.hub.on_engine_stats(StatsEvent("r", rig.gen.model_id, U64_MAX, U64_MAX, False))
    snap = rig.hub.snapshot(rig.gen)
    assert snap.last_mean_input_tps == 5000
    assert (snap.output_tps, snap.max_output_tps) == (0, 0)


def test_scanner_reads_the_engine_prompt_count() -> None:
    scanner = SseScanner()
    scanner.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    scanner.feed(b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1}}\n\n')
    assert (scanner.prompt_tokens, scanner.tokens) == (12, 1)
    responses = SseScanner()
    responses.feed(b'data: {"type":"response.output_text.delta","delta":"a"}\n\n')
    responses.feed(b'data: {"response":{"usage":{"input_tokens":9,"output_tokens":2}}}\n\n')
    assert (responses.prompt_tokens, responses.tokens) == (9, 2)
