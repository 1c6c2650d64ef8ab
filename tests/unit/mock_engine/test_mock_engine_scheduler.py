from __future__ import annotations

import pytest
from mock_timer import ManualTimer, recorder

from stargate.mock_engine.scheduler import Decode, DecodeScheduler
from stargate.mock_engine.timing import TimingConfig, jitter


async def test_tokens_follow_absolute_fractional_deadlines() -> None:
    timer = ManualTimer()
    scheduler = DecodeScheduler(TimingConfig(token_delay_ms=2.5), timer)
    times: list[float] = []
    decode = Decode(5, "r", 0, recorder(timer, times))
    scheduler.start(decode)
    timer.advance(1.0)
    assert times == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01])
    assert decode.done.result() == 5 and scheduler.active == 0


async def test_jitter_is_added_per_token() -> None:
    timer = ManualTimer()
    scheduler = DecodeScheduler(TimingConfig(token_delay_ms=1.0, decode_jitter_ms=5), timer)
    times: list[float] = []
    scheduler.start(Decode(3, "req-j", 5, recorder(timer, times)))
    timer.advance(1.0)
    expected_1 = (1.0 + jitter("req-j", "decode-1", 5)) / 1000
    expected_2 = expected_1 + (1.0 + jitter("req-j", "decode-2", 5)) / 1000
    assert times == pytest.approx([0.0, expected_1, expected_2])


async def test_emit_returning_false_stops_the_decode() -> None:
    timer = ManualTimer()
    scheduler = DecodeScheduler(TimingConfig(token_delay_ms=1.0), timer)
    decode = Decode(10, "r", 0, lambda i: i < 3)
    scheduler.start(decode)
    timer.advance(1.0)
    assert decode.done.result() == 3


async def test_cancel_releases_the_decode() -> None:
    timer = ManualTimer()
    scheduler = DecodeScheduler(TimingConfig(token_delay_ms=1.0), timer)
    times: list[float] = []
    decode = Decode(10, "r", 0, recorder(timer, times))
    scheduler.start(decode)
    timer.advance(0.0015)
    scheduler.cancel(decode)
    timer.advance(1.0)
    assert len(times) == 2 and scheduler.active == 0


async def test_continuous_batching_slows_decode_with_more_streams() -> None:
    timer = ManualTimer()
    config = TimingConfig(token_delay_ms=10.0, batching="continuous", decode_slowdown=0.5)
    scheduler = DecodeScheduler(config, timer)
    alone: list[float] = []
    scheduler.start(Decode(2, "a", 0, recorder(timer, alone)))
    timer.advance(1.0)
    assert alone[1] == pytest.approx(0.010)
    first: list[float] = []
    second: list[float] = []
    start = timer.now
    scheduler.start(Decode(2, "b", 0, recorder(timer, first)))
    scheduler.start(Decode(2, "c", 0, recorder(timer, second)))
    timer.advance(1.0)
    assert second[1] - start == pytest.approx(0.015)  # two decoding: 10 ms x (1 + 0.5)


async def test_pause_shifts_pending_tokens() -> None:
    timer = ManualTimer()
    scheduler = DecodeScheduler(TimingConfig(token_delay_ms=10.0), timer)
    times: list[float] = []
    scheduler.start(Decode(3, "r", 0, recorder(timer, times)))
    timer.advance(0.005)
    scheduler.pause()
    timer.advance(1.0)
    assert len(times) == 1
    scheduler.resume()
    timer.advance(1.0)
    assert times[1:] == pytest.approx([1.010, 1.020])
