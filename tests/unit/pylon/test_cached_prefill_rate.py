"""Input samples count the prompt work the engine did: with ``--engine-prefix-caching`` a turn's
growth, or its prompt less what the engine reports cached (the whole prompt over the time its
growth took published 60 000 tokens/s from engines prefilling 20 000)."""

from __future__ import annotations

import pytest

from stargate.pylon.stats.ndjson import StatsEvent
from stargate.pylon.stats.observation import Endpoint, Observation, State

from .helpers import Rig, make_rig


def streamed(rig: Rig, rid: str, tokens: int, prefill_s: float, key: str | None = "conv") -> None:
    """A request relayed as Pylon does, whose engine reports its whole prompt processed after
    ``prefill_s``."""
    rig.load.track(rid, rig.gen, 0, tokens, key)
    rig.hub.on_request_tracked(rid, rig.gen)
    rig.load.sent(rid)
    rig.hub.on_engine_stats(StatsEvent(rid, rig.gen.model_id, 0, 0, False))
    rig.clock.advance(prefill_s)
    rig.hub.on_engine_stats(StatsEvent(rid, rig.gen.model_id, tokens, 1, False))
    rig.load.release(rid)


def mean(rig: Rig) -> float:
    return rig.hub.snapshot(rig.gen).last_mean_input_tps


def test_a_turns_sample_counts_its_growth_not_its_cached_history() -> None:
    rig = make_rig(initial_input_tps=1000, prefix_caching=True)
    streamed(rig, "turn-1", 1000, 1.0)  # nothing cached: 1 000 tokens in 1 s
    streamed(rig, "turn-2", 1200, 0.2)  # 200 new tokens in 0.2 s, not 1 200
    assert mean(rig) == pytest.approx(1000)


def test_without_prefix_caching_every_prompt_token_counts_as_the_spec_says() -> None:
    rig = make_rig(initial_input_tps=1000)
    streamed(rig, "turn-1", 1000, 1.0)
    streamed(rig, "turn-2", 1200, 0.2)
    assert mean(rig) == pytest.approx((5 * 1000 + 1000 + 6000) / 7)


def test_a_fully_cached_prompt_is_no_sample() -> None:
    rig = make_rig(initial_input_tps=1000, prefix_caching=True)
    streamed(rig, "turn-1", 1000, 1.0)
    streamed(rig, "again", 1000, 0.02)  # no work at all
    streamed(rig, "one-more", 1001, 0.02)  # 1 token over a 20 ms step: the step, not the prefill
    assert mean(rig) == pytest.approx(1000)
    streamed(rig, "more", 1021, 0.01)  # 20 tokens: above the floor's worth (10) at 1 000 tokens/s
    assert mean(rig) == pytest.approx((6 * 1000 + 2000) / 7)


def complete(rig: Rig, rid: str, claimed: int, reported: int, cached: int | None) -> None:
    """A streamed chat whose first output came after 0.2 s, its usage as the engine reported it."""
    rig.hub.on_observation(
        Observation(
            request_id=rid,
            generation=rig.gen,
            endpoint=Endpoint.CHAT,
            state=State.COMPLETE,
            input_tokens=claimed,
            output_tokens=1,
            time_to_first_output=0.2,
            elapsed=0.3,
            reported_input_tokens=reported,
            reported_cached_tokens=cached,
        )
    )


def send_turn(rig: Rig, rid: str, tokens: int) -> None:
    """A turn of conversation ``conv`` admitted, sent to the engine and ended at Pylon."""
    rig.load.track(rid, rig.gen, 0, tokens, "conv")
    rig.hub.on_request_tracked(rid, rig.gen)
    rig.load.sent(rid)
    rig.load.release(rid)


def test_fallback_samples_subtract_what_the_engine_reports_cached() -> None:
    rig = make_rig(initial_input_tps=1000, fallback=True)
    complete(rig, "hit", 1200, 1200, 1000)  # 200 prefilled in 0.2 s
    assert mean(rig) == pytest.approx(1000)
    complete(rig, "full-hit", 1200, 1200, 1199)  # vLLM computes the last token again
    assert mean(rig) == pytest.approx(1000)
    complete(rig, "no-details", 200, 200, None)  # no cached count: every token
    assert mean(rig) == pytest.approx(1000)
    complete(rig, "miss", 1200, 1200, 0)
    assert mean(rig) == pytest.approx((7 * 1000 + 6000) / 8)


def test_the_engines_cached_count_wins_over_pylons() -> None:
    """Pylon does not see evictions: an engine that prefilled a turn whole says so."""
    rig = make_rig(initial_input_tps=1000, fallback=True, prefix_caching=True)
    for rid, tokens in (("turn-1", 1000), ("turn-2", 1200)):
        send_turn(rig, rid, tokens)
    complete(rig, "turn-2", 1200, 1200, 0)  # Pylon counted 200 of it
    assert mean(rig) == pytest.approx((5 * 1000 + 6000) / 6)


def test_fallback_samples_count_the_share_pylon_counted_as_work() -> None:
    rig = make_rig(initial_input_tps=1000, fallback=True, prefix_caching=True)
    for rid, tokens in (("turn-1", 1000), ("turn-2", 1200)):
        send_turn(rig, rid, tokens)
        complete(rig, rid, tokens, tokens, None)
    # turn-1: 1 000 tokens in 0.2 s; turn-2: 200 of 1 200 in 0.2 s.
    assert mean(rig) == pytest.approx((5 * 1000 + 5000 + 1000) / 7)
