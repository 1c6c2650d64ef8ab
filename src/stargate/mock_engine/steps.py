"""The ``vllm`` batching mode: an iteration-level scheduler with a per-step token budget.

The engine runs in steps, like vLLM's scheduler with chunked prefill. At the start of a step:

1. every running sequence that is decoding gets one token (admission order, within the budget);
2. running sequences still prefilling continue, in admission order, each taking
   ``min(remaining, budget left)`` prompt tokens (chunked prefill);
3. waiting sequences are admitted first-come-first-served while budget is left and fewer than
   ``max_running`` sequences run (0 = no limit); admission calls the sequence's ``admit``
   callback (stats, KV lookup), which returns its uncached tokens, and takes a first chunk.

Each prefill chunk calls the sequence's ``scheduled`` callback, if any, as it is scheduled, with
the uncached tokens computed once it completes: vLLM caches the full blocks a chunk covers when it
schedules the chunk, so a sequence admitted later, even in the same step, reuses them.

The step then lasts :func:`~stargate.mock_engine.timing.step_seconds` and, at its end, chunks are
applied (a finished prefill resolves ``Sequence.prefilled``) and each decoding sequence emits one
token. The next step is planned at once; with no work the engine idles until something arrives.

A sequence whose prefill has finished decodes from the next step on once its :class:`Decode` is
attached with :meth:`StepScheduler.start` (which emits token 0, the token the prefill sampled). A
sequence submitted with ``immediate`` (no first-token delay) joins the next step even before it is
attached; a token produced before that is emitted right after token 0. The timer is injected.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable

from .scheduler import Decode, Handle, Timer
from .timing import TimingConfig, step_seconds

WAITING, PREFILL, READY, DECODE, DONE = range(5)


class QueueFull(Exception):
    """Private signal: the waiting queue is at ``--max-waiting-requests`` (the handler answers 429)."""


class Sequence:
    """One request inside the step scheduler."""

    __slots__ = ("admit", "decode", "immediate", "left", "owed", "prefilled", "scheduled", "seq", "state",
                 "uncached")  # fmt: skip

    def __init__(
        self, seq: int, admit: Callable[[], int], immediate: bool, scheduled: Callable[[int], None] | None
    ) -> None:
        self.seq = seq
        self.admit = admit
        self.immediate = immediate
        self.scheduled = scheduled
        self.state = WAITING
        self.uncached = 0
        self.left = 0
        self.owed = 0
        self.decode: Decode | None = None
        self.prefilled: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class StepScheduler:
    """Owns admission, chunked prefill and decode of every generating request (``vllm`` mode)."""

    def __init__(self, timing: TimingConfig, max_running: int, max_waiting: int, timer: Timer) -> None:
        if timing.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self._timing = timing
        self._budget = timing.max_num_batched_tokens
        self._max_running = max_running
        self._max_waiting = max_waiting
        self._timer = timer
        self._ids = itertools.count()
        self._running: dict[int, Sequence] = {}  # admission order
        self._waiting: deque[Sequence] = deque()
        self._handle: Handle | None = None
        self._plan: tuple[list[Sequence], list[tuple[Sequence, int]]] | None = None
        self._paused = False
        self.prefill_tokens_pending = 0  # uncached prompt tokens admitted and not yet computed
        self.prompt_tokens_total = 0  # prompt tokens computed (prefill chunks completed)
        self.tokens_total = 0  # tokens emitted, counted as each is
        self.steps_total = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefilling(self) -> int:
        return sum(1 for s in self._running.values() if s.state == PREFILL)

    @property
    def decoding(self) -> int:
        return sum(1 for s in self._running.values() if s.state == DECODE)

    def submit(
        self, admit: Callable[[], int], immediate: bool, scheduled: Callable[[int], None] | None = None
    ) -> Sequence:
        """Queue a request; raises :class:`QueueFull` when ``max_waiting`` requests already wait for
        a place beyond ``max_running`` (0: none ever does). One queued only until the next step starts
        is not waiting for a place, as a free slot in the other modes is taken at once."""
        limit = self._max_running
        if limit > 0 and len(self._running) + len(self._waiting) - limit >= self._max_waiting:
            raise QueueFull
        sequence = Sequence(next(self._ids), admit, immediate, scheduled)
        self._waiting.append(sequence)
        self._kick()
        return sequence

    def start(self, sequence: Sequence, decode: Decode) -> None:
        """Attach the decode of a prefilled sequence: token 0 now, then one per step."""
        sequence.decode = decode
        if sequence.state == READY:
            sequence.state = DECODE
        if sequence.state != DECODE:
            return
        self._emit(sequence)
        while sequence.owed and sequence.state == DECODE:
            sequence.owed -= 1
            self._emit(sequence)
        self._kick()

    def cancel(self, sequence: Sequence, decode: Decode) -> None:
        """The client went away during decode."""
        if not decode.finished:
            decode.cancelled = True
            self._finish_decode(sequence, decode)
            self._kick()

    def release(self, sequence: Sequence) -> None:
        """The request is over (or abandoned while waiting or prefilling); frees its place."""
        if sequence.state == WAITING:
            self._waiting.remove(sequence)
        elif sequence.state == PREFILL:
            self.prefill_tokens_pending -= sequence.left
        sequence.state = DONE
        if self._running.pop(sequence.seq, None) is not None:
            self._kick()

    def pause(self) -> None:
        """No new step starts until :meth:`resume`; the current one completes."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._kick()

    # --- steps --------------------------------------------------------------------------------

    def _kick(self) -> None:
        if self._plan is None and not self._paused:
            self._start_step()

    def _start_step(self) -> None:
        budget = self._budget
        decodes: list[Sequence] = []
        chunks: list[tuple[Sequence, int]] = []
        for sequence in self._running.values():
            decoding = sequence.state == DECODE or (sequence.state == READY and sequence.immediate)
            if decoding and budget > 0:
                decodes.append(sequence)
                budget -= 1
        for sequence in self._running.values():
            if budget <= 0:
                break
            if sequence.state == PREFILL:
                budget -= self._schedule(sequence, budget, chunks)
        limit = self._max_running
        while self._waiting and budget > 0 and (limit <= 0 or len(self._running) < limit):
            sequence = self._waiting.popleft()
            sequence.state = PREFILL
            self._running[sequence.seq] = sequence
            # vLLM recomputes the last prompt token of a fully cached prompt: at least one token.
            sequence.uncached = sequence.left = max(1, sequence.admit())
            self.prefill_tokens_pending += sequence.left
            budget -= self._schedule(sequence, budget, chunks)
        if not decodes and not chunks:
            return
        self._plan = (decodes, chunks)
        duration = step_seconds(self._timing, sum(chunk for _, chunk in chunks), len(decodes))
        self._handle = self._timer.call_at(self._timer.time() + duration, self._end_step)

    @staticmethod
    def _schedule(sequence: Sequence, budget: int, chunks: list[tuple[Sequence, int]]) -> int:
        """Plan the sequence's next prefill chunk within ``budget``; returns its size."""
        chunk = min(sequence.left, budget)
        chunks.append((sequence, chunk))
        if sequence.scheduled is not None:
            sequence.scheduled(sequence.uncached - sequence.left + chunk)
        return chunk

    def _end_step(self) -> None:
        assert self._plan is not None
        decodes, chunks = self._plan
        self._plan = None
        self._handle = None
        self.steps_total += 1
        for sequence, chunk in chunks:
            if sequence.state != PREFILL:
                continue  # released meanwhile
            sequence.left -= chunk
            self.prefill_tokens_pending -= chunk
            self.prompt_tokens_total += chunk
            if sequence.left <= 0:
                sequence.state = READY
                if not sequence.prefilled.done():
                    sequence.prefilled.set_result(None)
        for sequence in decodes:
            if sequence.state == DECODE:
                self._emit(sequence)
            elif sequence.state == READY:
                sequence.owed += 1
        self._kick()

    def _emit(self, sequence: Sequence) -> None:
        decode = sequence.decode
        if decode is None or decode.finished:
            return
        index = decode.emitted
        if not decode.emit(index):
            self._finish_decode(sequence, decode)
            return
        decode.emitted = index + 1
        self.tokens_total += 1
        if decode.emitted >= decode.n:
            self._finish_decode(sequence, decode)

    def _finish_decode(self, sequence: Sequence, decode: Decode) -> None:
        decode.finished = True
        if not decode.done.done():
            decode.done.set_result(decode.emitted)
        sequence.state = DONE
        self._running.pop(sequence.seq, None)  # vLLM frees a finished sequence at once
