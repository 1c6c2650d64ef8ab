"""The vllm-style step scheduler on hand-computed cases (manual timer, no sleeps).

Unless a test says otherwise: prefill 1000 tokens/s, 10 ms per decode token, slowdown 0.5 per
extra decoding sequence, a budget of 100 tokens per step.
"""

from __future__ import annotations

import pytest
from mock_timer import ManualTimer, recorder

from stargate.mock_engine.scheduler import Decode
from stargate.mock_engine.steps import QueueFull, Sequence, StepScheduler
from stargate.mock_engine.timing import TimingConfig, step_seconds

TIMING = TimingConfig(
    token_delay_ms=10.0,
    prefill_tokens_per_s=1000.0,
    batching="vllm",
    decode_slowdown=0.5,
    max_num_batched_tokens=100,
)


def make(
    max_running: int = 0, max_waiting: int = 100, timing: TimingConfig = TIMING
) -> tuple[ManualTimer, StepScheduler]:
    timer = ManualTimer()
    return timer, StepScheduler(timing, max_running, max_waiting, timer)


def submit(steps: StepScheduler, uncached: int, *, immediate: bool = False) -> Sequence:
    return steps.submit(lambda: uncached, immediate)


def prefilled_at(timer: ManualTimer, sequence: Sequence, when: float) -> bool:
    """Prefill not finished just before ``when`` and finished at ``when`` (advances the timer)."""
    timer.advance(when - 1e-6 - timer.now)
    before = sequence.prefilled.done()
    timer.advance(when - timer.now)
    return not before and sequence.prefilled.done()


def test_step_seconds_is_the_larger_of_prefill_and_decode_cost() -> None:
    assert step_seconds(TIMING, 100, 0) == pytest.approx(0.100)
    assert step_seconds(TIMING, 0, 1) == pytest.approx(0.010)
    assert step_seconds(TIMING, 0, 3) == pytest.approx(0.020)  # 10 ms x (1 + 0.5 x 2)
    assert step_seconds(TIMING, 5, 3) == pytest.approx(0.020)  # memory-bound step
    assert step_seconds(TIMING, 97, 3) == pytest.approx(0.097)  # compute-bound step
    assert step_seconds(TimingConfig(batching="vllm"), 500, 0) == 0.0  # prefill disabled


async def test_long_prefill_is_chunked_by_the_budget() -> None:
    timer, steps = make()
    a = submit(steps, 250)
    assert steps.running == 1 and steps.prefill_tokens_pending == 250
    timer.advance(0.15)
    assert steps.prefill_tokens_pending == 150
    assert prefilled_at(timer, a, 0.250)  # chunks 100 + 100 + 50
    assert steps.prompt_tokens_total == 250 and steps.steps_total == 3


async def test_each_chunk_reports_the_tokens_computed_when_it_is_scheduled() -> None:
    timer, steps = make()
    events: list[tuple[str, float, int]] = []

    def admit_b() -> int:
        events.append(("b admitted", timer.now, 0))
        return 30

    steps.submit(lambda: 250, False, lambda computed: events.append(("a", timer.now, computed)))
    timer.advance(0.05)
    steps.submit(admit_b, False, lambda computed: events.append(("b", timer.now, computed)))
    timer.advance(1.0)
    # A's chunks 100, 100, 50 at 0, 0.1 and 0.2 s; in the third step A's last chunk is scheduled
    # (and cached) before B is admitted, so B's lookup sees all of A's blocks.
    assert events == [
        ("a", 0.0, 100),
        ("a", pytest.approx(0.1), 200),
        ("a", pytest.approx(0.2), 250),
        ("b admitted", pytest.approx(0.2), 0),
        ("b", pytest.approx(0.2), 30),
    ]


async def test_waiting_prefills_are_admitted_first_come_first_served() -> None:
    timer, steps = make()
    a = submit(steps, 150)
    b = submit(steps, 30)
    assert steps.running == 1 and steps.waiting == 1  # the first step started with A alone
    # step 1: A 100 (0.1 s); step 2: A's last 50 and B's 30 share the budget (0.08 s)
    assert prefilled_at(timer, b, 0.180) and a.prefilled.done()


async def test_decode_tokens_come_first_and_prefill_takes_the_rest() -> None:
    timer, steps = make()
    a = submit(steps, 10)
    timer.advance(0.010)
    assert a.prefilled.done()
    tokens: list[float] = []
    steps.start(a, Decode(4, "a", 0, recorder(timer, tokens)))
    b = submit(steps, 200)
    timer.advance(1.0)
    # token 0 at 0.010; step 2 (A decodes alone) ends 0.020; step 3: A 1 token + B 99 prompt
    # tokens -> 0.099 s; step 4: A 1 token + B 99 -> 0.099 s
    assert tokens == pytest.approx([0.010, 0.020, 0.119, 0.218])
    assert b.prefilled.done()


async def test_decode_slows_with_the_batch() -> None:
    timer, steps = make()
    a, b = submit(steps, 5), submit(steps, 5)
    timer.advance(0.005)  # step 1: A alone (B arrived during it); step 2: B's 5 tokens
    first: list[float] = []
    steps.start(a, Decode(3, "a", 0, recorder(timer, first)))
    timer.advance(0.010)  # step 3 (from 0.010): A decodes alone, 10 ms
    second: list[float] = []
    steps.start(b, Decode(3, "b", 0, recorder(timer, second)))
    timer.advance(1.0)
    # step 4 (from 0.020): two decoding, 10 ms x 1.5; step 5: B alone, 10 ms
    assert first == pytest.approx([0.005, 0.020, 0.035])
    assert second == pytest.approx([0.015, 0.035, 0.045])


async def test_concurrency_limit_keeps_requests_waiting() -> None:
    timer, steps = make(max_running=1)
    a = submit(steps, 10)
    b = submit(steps, 10)
    timer.advance(0.010)
    assert (steps.running, steps.waiting) == (1, 1)
    steps.start(a, Decode(2, "a", 0, recorder(timer, [])))
    timer.advance(0.010)  # A's last token: A leaves, B is admitted in the next step
    assert (steps.running, steps.waiting) == (1, 0) and not b.prefilled.done()
    timer.advance(0.010)
    assert b.prefilled.done()


async def test_immediate_sequence_joins_the_next_step_before_it_is_attached() -> None:
    timer, steps = make()
    a = submit(steps, 100, immediate=True)
    timer.advance(0.100)
    tokens: list[float] = []
    steps.start(a, Decode(3, "a", 0, recorder(timer, tokens)))
    timer.advance(1.0)
    assert tokens == pytest.approx([0.100, 0.110, 0.120])
    late = submit(steps, 100, immediate=True)
    timer.advance(0.115)  # prefilled at 1.2; its first decode step ended at 1.21, before attach
    late_tokens: list[float] = []
    steps.start(late, Decode(3, "late", 0, recorder(timer, late_tokens)))
    timer.advance(1.0)
    assert late_tokens == pytest.approx([1.215, 1.215, 1.220])


async def test_fully_cached_prompt_still_computes_one_token() -> None:
    timer, steps = make()
    a = submit(steps, 0)
    timer.advance(0.0005)
    assert not a.prefilled.done()
    timer.advance(0.0005)
    assert a.prefilled.done()


async def test_waiting_queue_cap_and_release_while_waiting() -> None:
    timer, steps = make(max_running=1, max_waiting=1)
    a = submit(steps, 50)
    b = submit(steps, 50)
    with pytest.raises(QueueFull):
        submit(steps, 50)
    steps.release(b)
    assert steps.waiting == 0
    steps.release(a)  # abandoned mid-prefill: its pending tokens leave with it
    assert steps.running == 0 and steps.prefill_tokens_pending == 0
    timer.advance(1.0)
    assert not a.prefilled.done() and steps.running == 0


async def test_waiting_queue_cap_counts_only_requests_beyond_the_concurrency_limit() -> None:
    timer, steps = make(max_running=2, max_waiting=0)
    submit(steps, 50)
    b = submit(steps, 50)  # arrives during A's step: waits for the next one, not for a place
    assert steps.waiting == 1
    with pytest.raises(QueueFull):
        submit(steps, 50)
    timer.advance(0.050)
    assert (steps.running, steps.waiting) == (2, 0) and not b.prefilled.done()
    _, unlimited = make(max_running=0, max_waiting=0)
    for _ in range(3):
        submit(unlimited, 50)  # without a limit nothing waits for a place
    assert unlimited.waiting == 2


async def test_admission_runs_the_callback_when_the_sequence_is_admitted() -> None:
    timer, steps = make(max_running=1)
    admitted: list[float] = []

    def admit() -> int:
        admitted.append(timer.now)
        return 10

    a = submit(steps, 10)
    steps.submit(admit, False)
    timer.advance(0.010)
    steps.start(a, Decode(1, "a", 0, recorder(timer, [])))  # one token: A is done at once
    timer.advance(0.001)
    assert admitted == [pytest.approx(0.010)]


async def test_pause_holds_the_next_step() -> None:
    timer, steps = make()
    a = submit(steps, 150)
    steps.pause()
    timer.advance(1.0)
    assert steps.prefill_tokens_pending == 50  # the running step completed, no new one started
    steps.resume()
    timer.advance(0.050)
    assert a.prefilled.done()


async def test_cancelled_decode_frees_its_place() -> None:
    timer, steps = make(max_running=1)
    a = submit(steps, 10)
    b = submit(steps, 10)
    timer.advance(0.010)
    decode = Decode(10, "a", 0, recorder(timer, []))
    steps.start(a, decode)
    steps.cancel(a, decode)
    assert decode.done.result() == 1 and steps.decoding == 0 and steps.running == 0
    # the step already running (A's decode) completes at 0.02; B is admitted then
    assert prefilled_at(timer, b, 0.030)
