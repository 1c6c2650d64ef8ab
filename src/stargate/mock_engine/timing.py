"""The timing model: deterministic jitter, prefill, first-token and per-token decode delays.

Three batching modes (see docs/mock-engine.md for the formulas):

* ``independent`` (the original): each request prefills at the full ``prefill_tps`` and decodes
  one token per ``token_delay_ms``, whatever else runs.
* ``continuous``: requests prefilling at the same time share ``prefill_tps`` equally (processor
  sharing, :class:`ProcessorSharing`), and the per-token delay grows linearly with the number of
  requests decoding at that moment: ``token_delay_ms x (1 + decode_slowdown x (decoding - 1))``.
* ``vllm``: an iteration-level scheduler (:mod:`~stargate.mock_engine.steps`); each engine step
  computes ``p`` prompt tokens and one token for each of ``d`` decoding sequences and lasts
  :func:`step_seconds` = ``max(p / prefill_tps, step_ms(d) / 1000)``.

All delays are floats in seconds: the per-token delay is never truncated to whole milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from stargate.wire.limits import U64_MAX

Batching = Literal["independent", "continuous", "vllm"]
BATCHING_MODES: tuple[Batching, ...] = ("independent", "continuous", "vllm")

_FNV_START = 1469598103934665603  # the source's literal; not the standard FNV-1a offset basis
_FNV_PRIME = 1099511628211
_MASK = U64_MAX


def _fnv(state: int, data: bytes) -> int:
    for byte in data:
        state = ((state ^ byte) * _FNV_PRIME) & _MASK
    return state


def jitter(request_id: str, salt: str, max_jitter: int) -> int:
    """Deterministic uniform integer in [0, max_jitter] keyed by request id and salt (spec §4.2)."""
    if max_jitter <= 0:
        return 0
    value = _fnv(_fnv(_FNV_START, request_id.encode()), salt.encode())
    if max_jitter >= _MASK:
        return value
    return value % (max_jitter + 1)


class RequestJitter:
    """Jitter of one request with the request-id part of the hash computed once."""

    __slots__ = ("_max", "_state")

    def __init__(self, request_id: str, max_jitter: int) -> None:
        self._max = max_jitter
        self._state = _fnv(_FNV_START, request_id.encode()) if max_jitter > 0 else 0

    def get(self, salt: str) -> int:
        if self._max <= 0:
            return 0
        value = _fnv(self._state, salt.encode())
        return value if self._max >= _MASK else value % (self._max + 1)


@dataclass(frozen=True, slots=True)
class TimingConfig:
    num_tokens: int = 10
    token_delay_ms: float = 100.0
    decode_jitter_ms: int = 0
    ttft_ms: float = 0.0
    ttft_jitter_ms: int = 0
    prefill_tokens_per_s: float = 0.0
    batching: Batching = "independent"
    decode_slowdown: float = 0.05
    max_num_batched_tokens: int = 2048

    @property
    def prefill_enabled(self) -> bool:
        return self.prefill_tokens_per_s > 0 and math.isfinite(self.prefill_tokens_per_s)


def prefill_seconds(uncached_tokens: int, prefill_tps: float) -> float:
    """Prefill time of ``uncached_tokens`` alone on the engine; 0 when the rate is off or invalid."""
    if not (prefill_tps > 0 and math.isfinite(prefill_tps)) or uncached_tokens <= 0:
        return 0.0
    return uncached_tokens / prefill_tps


def first_token_delay_s(config: TimingConfig, request_id: str) -> float:
    return (config.ttft_ms + jitter(request_id, "ttft", config.ttft_jitter_ms)) / 1000.0


def decode_step_ms(config: TimingConfig, decoding: int) -> float:
    """Base per-token delay with ``decoding`` requests in decode (jitter excluded)."""
    if config.batching != "independent" and decoding > 1:
        return config.token_delay_ms * (1.0 + config.decode_slowdown * (decoding - 1))
    return config.token_delay_ms


def step_seconds(config: TimingConfig, prefill_tokens: int, decodes: int) -> float:
    """Duration of one ``vllm`` engine step: the larger of its prefill and its decode cost.

    A step is compute-bound (prompt tokens at ``prefill_tps``) or memory-bound (one weight read
    plus a KV read per decoding sequence, the ``continuous`` decode delay), whichever dominates; so
    a prefill backlog still runs at ``prefill_tps`` and a decode-only batch at ``step_ms(d)``.
    """
    prefill = prefill_seconds(prefill_tokens, config.prefill_tokens_per_s)
    decode = decode_step_ms(config, decodes) / 1000.0 if decodes > 0 else 0.0
    return max(prefill, decode)


class ProcessorSharing:
    """Egalitarian processor sharing of a rate among jobs, in virtual time (pure; time passed in).

    Virtual time ``V`` advances at ``rate / n`` per second while ``n`` jobs are active; a job of
    ``work`` units admitted at virtual time ``V0`` completes when ``V`` reaches ``V0 + work``.
    """

    _EPS = 1e-9

    def __init__(self, rate: float, now: float) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError("rate must be positive and finite")
        self._rate = rate
        self._virtual = 0.0
        self._last = now
        self._finish: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._finish)

    def _advance(self, now: float) -> None:
        if self._finish and now > self._last:
            self._virtual += (now - self._last) * self._rate / len(self._finish)
        self._last = max(self._last, now)

    def add(self, job: int, work: float, now: float) -> None:
        self._advance(now)
        self._finish[job] = self._virtual + max(0.0, work)

    def remove(self, job: int, now: float) -> None:
        self._advance(now)
        self._finish.pop(job, None)

    def pop_finished(self, now: float) -> list[int]:
        self._advance(now)
        done = [job for job, end in self._finish.items() if end <= self._virtual + self._EPS]
        for job in done:
            del self._finish[job]
        return done

    def next_finish(self, now: float) -> float | None:
        """Absolute time of the next completion if no job joins or leaves before it."""
        self._advance(now)
        if not self._finish:
            return None
        remaining = min(self._finish.values()) - self._virtual
        return self._last + max(0.0, remaining) * len(self._finish) / self._rate
