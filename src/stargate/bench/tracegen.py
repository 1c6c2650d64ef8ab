"""Synthetic traces in the Mooncake format: multi-turn conversations, shared system prompts, bursts.

Each conversation picks one of a few system prompts (long prefixes shared across conversations),
then runs 1..``max_turns`` turns; turn ``k+1``'s prompt is turn ``k``'s prompt plus its answer plus a
new user message, so it extends the previous prompt token for token. Conversations start by a
Poisson process whose rate is ``burst_factor`` times higher during the first ``burst_s`` seconds of
every ``burst_period_s``; a later turn follows the previous one after a think time (at least
``min_think_s``, exponential beyond it). Prompts stop growing at ``max_input_tokens`` (the
conversation ends there).

Hash ids follow the Mooncake rule: block ``j`` of a prompt is ``block_tokens`` tokens; a block that
lies inside the system prompt is shared by every conversation using it, a later full block belongs
to its conversation (the same id in every later turn), and a partial last block is unique. Ids are
numbered in order of first appearance. Everything is fixed by the seed.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from stargate.bench.schema import MAX_REQUEST_COUNT, MAX_TOKENS
from stargate.errors import ConfigError
from stargate.flags import FlagSet


@dataclass(frozen=True)
class TraceShape:
    conversations: int = 120
    system_prompts: int = 3
    system_tokens: int = 1024
    max_turns: int = 5
    first_user_tokens: int = 2500
    turn_user_tokens: int = 400
    output_tokens: int = 120
    conversation_rate: float = 1.0  # conversation starts per second outside bursts
    burst_factor: float = 5.0
    burst_period_s: float = 30.0
    burst_s: float = 6.0
    min_think_s: float = 3.0
    mean_extra_think_s: float = 6.0
    max_input_tokens: int = 16384
    block_tokens: int = 512


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    conversation: int  # ground truth for tests; not written
    turn: int

    def to_json(self) -> bytes:
        return orjson.dumps({
            "timestamp": self.timestamp_ms, "input_length": self.input_length,
            "output_length": self.output_length, "hash_ids": list(self.hash_ids),
        })  # fmt: skip


def _lognormal(rng: random.Random, median: int, sigma: float = 0.6) -> int:
    return max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _starts(shape: TraceShape, rng: random.Random) -> list[float]:
    """Conversation start times: Poisson, ``burst_factor`` x faster inside each burst window.

    Drawn by thinning a Poisson process at the peak rate: a gap drawn at the rate of the moment it
    starts would run a quiet gap over the next burst, which then starts fewer than promised.
    """
    times: list[float] = []
    peak = shape.conversation_rate * max(1.0, shape.burst_factor)
    now = 0.0
    while len(times) < shape.conversations:
        now += rng.expovariate(peak)
        in_burst = (now % shape.burst_period_s) < shape.burst_s
        rate = shape.conversation_rate * (shape.burst_factor if in_burst else 1.0)
        if rng.random() * peak < rate:
            times.append(now)
    return times


def _blocks(shape: TraceShape, system: int, system_tokens: int, conversation: int, length: int
            ) -> list[tuple[object, ...]]:  # fmt: skip
    size = shape.block_tokens
    keys: list[tuple[object, ...]] = []
    for j in range(math.ceil(length / size)):
        end = (j + 1) * size
        if end <= system_tokens:
            keys.append(("system", system, j))
        elif end <= length:
            keys.append(("conversation", conversation, j))
        else:
            keys.append(("partial", conversation, j, length))
    return keys


def generate_trace(shape: TraceShape, seed: int) -> list[TraceRow]:
    """The rows of one synthetic trace, sorted by timestamp; the same shape and seed give the same rows."""
    rng = random.Random(f"stargate-bench:tracegen:{seed}")
    system_sizes = [_lognormal(rng, shape.system_tokens, 0.3) for _ in range(shape.system_prompts)]
    pending: list[tuple[float, int, int, int, int, list[tuple[object, ...]]]] = []
    for conversation, start in enumerate(_starts(shape, rng)):
        system = rng.randrange(shape.system_prompts)
        length = system_sizes[system] + _lognormal(rng, shape.first_user_tokens)
        at = start
        for turn in range(rng.randint(1, shape.max_turns)):
            if length > shape.max_input_tokens:
                break
            output = min(_lognormal(rng, shape.output_tokens, 0.5), MAX_TOKENS)
            blocks = _blocks(shape, system, system_sizes[system], conversation, length)
            pending.append((at, conversation, turn, length, output, blocks))
            at += shape.min_think_s + rng.expovariate(1.0 / shape.mean_extra_think_s)
            length += output + _lognormal(rng, shape.turn_user_tokens)
    pending.sort(key=lambda item: (item[0], item[1], item[2]))
    ids: dict[tuple[object, ...], int] = {}
    rows = []
    for at, conversation, turn, length, output, blocks in pending:
        hash_ids = tuple(ids.setdefault(key, len(ids)) for key in blocks)
        rows.append(TraceRow(round(at * 1000.0), length, output, hash_ids, conversation, turn))
    return rows


def write_trace(path: Path, rows: Iterable[TraceRow]) -> int:
    """Write JSONL; returns the number of rows."""
    lines = [row.to_json() for row in rows]
    path.write_bytes(b"\n".join(lines) + b"\n" if lines else b"")
    return len(lines)


_FLAGS = {
    "conversations": "conversations to generate",
    "system_prompts": "distinct shared system prompts",
    "system_tokens": "median system prompt length (tokens)",
    "max_turns": "turns per conversation: uniform in 1..N",
    "first_user_tokens": "median first user message (tokens)",
    "turn_user_tokens": "median later user message (tokens)",
    "output_tokens": "median answer length (tokens)",
    "conversation_rate": "conversation starts per second outside bursts",
    "burst_factor": "start rate multiplier inside a burst",
    "burst_period_s": "seconds from one burst to the next",
    "burst_s": "burst length (s)",
    "min_think_s": "minimum gap between turns (s)",
    "mean_extra_think_s": "mean exponential gap added to it (s)",
    "max_input_tokens": "a conversation ends before a prompt would exceed this",
    "block_tokens": "tokens per hash block",
}


_DAY_S = 86_400.0
_LIMITS: dict[str, tuple[float, float]] = {
    "conversations": (0, MAX_REQUEST_COUNT),
    "system_tokens": (0, MAX_TOKENS),
    "first_user_tokens": (0, MAX_TOKENS),
    "turn_user_tokens": (0, MAX_TOKENS),
    "output_tokens": (0, MAX_TOKENS),
    "conversation_rate": (1 / _DAY_S, math.inf),
    "burst_factor": (0, 1000.0),
    "burst_period_s": (0, _DAY_S),
    "burst_s": (0, _DAY_S),
    "min_think_s": (0, _DAY_S),
    "mean_extra_think_s": (0, _DAY_S),
    "max_input_tokens": (0, MAX_TOKENS),
    "block_tokens": (0, MAX_TOKENS),
}
"""Flag ranges beyond > 0: token counts the replay accepts (:data:`MAX_TOKENS`), and times and rates
that keep every timestamp a finite whole number of milliseconds (a day is longer than any trace)."""


def _check_flags(values: Mapping[str, float]) -> None:
    for name, value in values.items():
        low, high = _LIMITS.get(name, (0, math.inf))
        flag = "--" + name.replace("_", "-")
        if not value > 0:
            raise ConfigError("must be > 0", path=flag)
        if value < low:
            raise ConfigError(f"must be at least {_shown(low)} (one a day), got {_shown(value)}", path=flag)
        if not value <= high:
            raise ConfigError(f"must be at most {_shown(high)}, got {_shown(value)}", path=flag)


def _shown(value: float) -> str:
    whole = math.isfinite(value) and value == int(value) and value < 1e16
    return str(int(value)) if whole else f"{value:.6g}"


def add_parser(sub: Any, env: Mapping[str, str]) -> None:
    """One flag per ``TraceShape`` field; its default is the field's."""
    help_text = "write a synthetic conversation trace in the Mooncake format"
    a = FlagSet(sub.add_parser("gen-trace", help=help_text), env).add
    a("--out", type=Path, required=True, help="JSONL file to write")
    a("--seed", type=int, default=0, help="the trace is fixed by the seed")
    defaults = TraceShape()
    for field in fields(TraceShape):
        value = getattr(defaults, field.name)
        a("--" + field.name.replace("_", "-"), type=type(value), default=value, help=_FLAGS[field.name])


def gen_trace_command(console: Console, args: argparse.Namespace) -> int:
    values = {field.name: getattr(args, field.name) for field in fields(TraceShape)}
    _check_flags(values)
    rows = generate_trace(TraceShape(**values), args.seed)
    if not rows:
        reason = f"no conversation's first prompt fits in {args.max_input_tokens} tokens: the trace is empty"
        raise ConfigError(reason, path="--max-input-tokens")
    count = write_trace(args.out, rows)
    seconds = rows[-1].timestamp_ms / 1000
    conversations = len({row.conversation for row in rows})
    console.print(f"wrote {count} requests of {conversations} conversations over {seconds:.0f} s "
                  f"to {args.out}", highlight=False)  # fmt: skip
    return 0
