from __future__ import annotations

import math

import pytest

from stargate.mock_engine.timing import (
    ProcessorSharing,
    RequestJitter,
    TimingConfig,
    decode_step_ms,
    first_token_delay_s,
    jitter,
    prefill_seconds,
)


def test_s9_24_prefill_seconds_proportional_to_uncached_tokens() -> None:
    assert prefill_seconds(4000, 2000.0) == 2.0
    for tps in (0.0, math.nan, math.inf, -5.0):
        assert prefill_seconds(4000, tps) == 0.0


def test_s9_25_decode_jitter_in_range_and_deterministic() -> None:
    values = [jitter("req-x", f"decode-{i}", 10) for i in range(1, 200)]
    assert all(0 <= v <= 10 for v in values)
    assert len(set(values)) > 5
    assert values == [jitter("req-x", f"decode-{i}", 10) for i in range(1, 200)]
    cached = RequestJitter("req-x", 10)
    assert values == [cached.get(f"decode-{i}") for i in range(1, 200)]


def test_s9_26_jitter_test_vector_and_zero_max() -> None:
    assert jitter("request-a", "salt", 2**64 - 1) == 18127296015107935538
    assert RequestJitter("request-a", 2**64 - 1).get("salt") == 18127296015107935538
    assert jitter("request-a", "salt", 0) == 0


def test_first_token_delay_adds_jitter_to_base() -> None:
    config = TimingConfig(ttft_ms=120.0, ttft_jitter_ms=30)
    expected = (120.0 + jitter("r1", "ttft", 30)) / 1000.0
    assert first_token_delay_s(config, "r1") == pytest.approx(expected)


def test_decode_delay_keeps_fractional_milliseconds() -> None:
    assert decode_step_ms(TimingConfig(token_delay_ms=3.846), 1) == 3.846


def test_continuous_decode_delay_grows_with_decoding_requests() -> None:
    config = TimingConfig(token_delay_ms=10.0, batching="continuous", decode_slowdown=0.1)
    assert decode_step_ms(config, 1) == 10.0
    assert decode_step_ms(config, 11) == pytest.approx(20.0)
    independent = TimingConfig(token_delay_ms=10.0, decode_slowdown=0.1)
    assert decode_step_ms(independent, 11) == 10.0


def test_processor_sharing_single_job_runs_at_full_rate() -> None:
    ps = ProcessorSharing(1000.0, now=0.0)
    ps.add(1, 500, now=0.0)
    assert ps.next_finish(0.0) == pytest.approx(0.5)
    assert ps.pop_finished(0.49) == []
    assert ps.pop_finished(0.5) == [1]


def test_processor_sharing_splits_rate_between_concurrent_jobs() -> None:
    ps = ProcessorSharing(1000.0, now=0.0)
    ps.add(1, 1000, now=0.0)
    ps.add(2, 1000, now=0.0)
    assert ps.next_finish(0.0) == pytest.approx(2.0)  # both at half rate
    ps2 = ProcessorSharing(1000.0, now=0.0)
    ps2.add(1, 1000, now=0.0)
    ps2.add(2, 250, now=0.5)  # job 1 has 500 left; both now at 500/s
    assert ps2.next_finish(0.5) == pytest.approx(1.0)
    assert ps2.pop_finished(1.0) == [2]
    assert ps2.next_finish(1.0) == pytest.approx(1.25)  # 250 left at full rate


def test_processor_sharing_removed_job_frees_its_share() -> None:
    ps = ProcessorSharing(100.0, now=0.0)
    ps.add(1, 100, now=0.0)
    ps.add(2, 100, now=0.0)
    ps.remove(2, now=1.0)  # job 1 got 50 in the first second
    assert ps.next_finish(1.0) == pytest.approx(1.5)
    assert len(ps) == 1
