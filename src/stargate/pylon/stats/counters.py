"""Per-request cumulative counter accounting (spec pylon.md §6.3).

Each request id has one entry: *observed* (owner generation known from Pylon's own tracking),
*live* (counter state) or *finalized* (tombstone). A request Pylon saw end is *ended*: no longer
live, though the engine's late events still count (an engine sends no ``finished`` for a request
whose client hung up, which otherwise stayed live until the 300 s sweep and then counted as a
stale cleanup). Counter deltas become ``(units, duration)``
samples; a dimension accumulates until it has ≥ 1 unit over ≥ the 10 ms floor, except the very
first input sample from zero, whose duration is raised to the floor.

Counts have a time base only from an earlier event of the request: the counts of its first event
are a baseline, not a sample (the spec measures them over the 10 ms floor, and a non-streamed
request's one ``finished`` event of 20 tokens published 2 000 tokens/s from an engine making 20).
Output is measured from the first event that reports a token, so its rate is the decode rate, not
one token over the time to the first. An entry keeps the share of its request's prompt that Pylon
counted as work (``prefill_share``): the engine's ``tokens_processed`` counts a cached prefix too,
which it did not prefill. Entries live up to
``REQUEST_TTL_S``, so a long request id is kept by its digest (``remembered``): 8 KB ids took a
Pylon from 77 to 203 MB in three minutes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from stargate.pylon.models import Generation
from stargate.pylon.stats.aggregate import DURATION_FLOOR_S
from stargate.wire.limits import remembered

REQUEST_TTL_S = 300.0
MAX_ENTRIES = 200_000
EPSILON_S = 1e-9  # float clocks: 11 ms - 1 ms must still count as 10 ms


class Outcome(StrEnum):
    APPLIED = "applied"
    POST_FINALIZE = "post_finalize"
    REGRESSING = "regressing_counters"


@dataclass(slots=True)
class _Counter:
    observed: int = 0
    sampled: int = 0
    sampled_at: float = 0.0

    def update(self, new: int, at: float, floor_s: float, *, from_zero: bool) -> tuple[int, float] | None:
        units = new - self.sampled
        first_from_zero = self.sampled == 0 and self.observed == 0
        self.observed = new
        if units < 1:
            return None
        if first_from_zero and not from_zero:
            self.sampled, self.sampled_at = new, at
            return None
        duration = at - self.sampled_at
        if first_from_zero:
            duration = max(duration, floor_s)
        elif duration < floor_s - EPSILON_S:
            return None
        self.sampled, self.sampled_at = new, at
        return units, duration


@dataclass(slots=True)
class _Entry:
    generation: Generation
    seen_at: float
    live: bool = False
    finalized: bool = False
    ended: bool = False
    prefill_share: float = 1.0
    input: _Counter = field(default_factory=_Counter)
    output: _Counter = field(default_factory=_Counter)


@dataclass(frozen=True, slots=True)
class CounterResult:
    outcome: Outcome
    input_sample: tuple[int, float] | None = None
    output_sample: tuple[int, float] | None = None
    prefill_share: float = 1.0


class CounterTracker:
    def __init__(self, floor_s: float = DURATION_FLOOR_S) -> None:
        self._floor = floor_s
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def live_count(self) -> int:
        return sum(1 for e in self._entries.values() if e.live and not (e.finalized or e.ended))

    def observe(
        self, request_id: str, generation: Generation, now: float, prefill_share: float = 1.0
    ) -> None:
        """Remember the owner generation of a request Pylon is proxying and the share of its prompt
        counted as work; an id used again once Pylon saw its request end counts as live again (a
        tombstone stays). Its counters start over only if the engine sent none for the earlier
        request: one it may still be running would send its own cumulative counts, read from zero
        as a burst of tokens in no time."""
        request_id = remembered(request_id)
        entry = self._entries.get(request_id)
        if entry is not None and entry.generation == generation and entry.ended and entry.live:
            entry.ended = False
            entry.prefill_share = prefill_share
        elif entry is None or entry.generation != generation or (entry.ended and not entry.finalized):
            self._entries.pop(request_id, None)
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.popitem(last=False)
            self._entries[request_id] = _Entry(generation, now, prefill_share=prefill_share)

    def end(self, request_id: str, generation: Generation, now: float) -> None:
        """Pylon saw the request end: it is no longer live, and its owner is kept for the engine's
        late events."""
        key = remembered(request_id)
        entry = self._entries.get(key)
        if entry is not None and entry.generation == generation:
            entry.ended = True
            self._seen(key, entry, now)

    def owner(self, request_id: str) -> Generation | None:
        entry = self._entries.get(remembered(request_id))
        return entry.generation if entry is not None else None

    def prefill_share(self, request_id: str, generation: Generation) -> float:
        entry = self._entries.get(remembered(request_id))
        return entry.prefill_share if entry is not None and entry.generation == generation else 1.0

    def apply(
        self,
        request_id: str,
        generation: Generation,
        *,
        tokens_processed: int | None,
        tokens_generated: int | None,
        finished: bool,
        now: float,
    ) -> CounterResult:
        """Apply one cumulative counter event; the first event's values are the baseline."""
        request_id = remembered(request_id)
        entry = self._entries.get(request_id)
        if entry is not None and entry.generation == generation and entry.finalized:
            return CounterResult(Outcome.POST_FINALIZE)
        if entry is None or entry.generation != generation or not entry.live:
            earlier = entry if entry is not None and entry.generation == generation else None
            ended = earlier is not None and earlier.ended
            share = earlier.prefill_share if earlier is not None else 1.0
            entry = _Entry(generation, now, live=True, ended=ended, prefill_share=share)
            entry.input.sampled_at = entry.output.sampled_at = now
            for counter, value in ((entry.input, tokens_processed), (entry.output, tokens_generated)):
                if value is not None:
                    counter.observed = counter.sampled = value
            self._entries.pop(request_id, None)
            self._entries[request_id] = entry
        for counter, value in ((entry.input, tokens_processed), (entry.output, tokens_generated)):
            if value is not None and value < counter.observed:
                return CounterResult(Outcome.REGRESSING)
        self._seen(request_id, entry, now)
        in_sample = (
            entry.input.update(tokens_processed, now, self._floor, from_zero=True)
            if tokens_processed is not None
            else None
        )
        out_sample = (
            entry.output.update(tokens_generated, now, self._floor, from_zero=False)
            if tokens_generated is not None
            else None
        )
        if finished:
            entry.finalized = True
        return CounterResult(Outcome.APPLIED, in_sample, out_sample, entry.prefill_share)

    def _seen(self, request_id: str, entry: _Entry, now: float) -> None:
        """Entries are kept in the order they were last seen, so a sweep reads only those due."""
        entry.seen_at = now
        self._entries.move_to_end(request_id)

    def sweep(self, now: float) -> int:
        """Finalize live entries unseen for 300 s and delete old tombstones and ended entries;
        returns finalized count. Reads only the entries due, oldest first (a full store of 200 000
        read each second held the event loop 50-76 ms)."""
        due = []
        for rid, entry in self._entries.items():
            if now - entry.seen_at < REQUEST_TTL_S:
                break
            due.append((rid, entry))
        finalized = 0
        for rid, entry in due:
            if entry.live and not (entry.finalized or entry.ended):
                entry.finalized = True
                self._seen(rid, entry, now)
                finalized += 1
            else:
                del self._entries[rid]
        return finalized

    def purge_generation(self, generation: Generation) -> None:
        for rid in [rid for rid, e in self._entries.items() if e.generation == generation]:
            del self._entries[rid]
