"""Replay of the public Mooncake trace format: JSONL rows of block hash ids, rebuilt into prompts.

A row is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``;
``hash_ids[j]`` names the ``j``-th block of ``block_tokens`` (512) prompt tokens, and two rows with
the same id at the same position share that block and everything before it. The last block of a row
may be partial.

Prompts are rebuilt block by block: block ``h`` is the same deterministic text wherever it appears
(:meth:`PromptBuilder.block`, ``4 x block_tokens`` bytes), so text-reading routers and the mock's
prefix cache see the reuse the trace describes. The conversation key (sent as
``x-cache-affinity-key``) follows :func:`conversation_keys`. A turn's partial last block is the start
of the block its conversation's next turn has there (and when that block is still partial there, of
the one the turn after has, and so on): the trace gives that block a new id because it grew, but
the text it grew from is the same, so each turn's prompt starts with the whole prompt of the turn
before, as a conversation's does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from stargate.bench.prompts import PromptBuilder
from stargate.bench.schema import MAX_TOKENS
from stargate.errors import ConfigError
from stargate.mock_engine.tokens import BYTES_PER_TOKEN

USER_OVERHEAD = len("user") + 2  # the engine's canonical chat bytes: role NUL content NUL
_MAX_REGISTRATIONS = 8


@dataclass(frozen=True)
class TraceRequest:
    """One replayed row: offset from the earliest row (scaled), conversation, turn and prompt text."""

    at_ms: float
    conversation: str
    turn: int
    input_tokens: int
    output_tokens: int
    prompt: str


@dataclass(frozen=True)
class MooncakeRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def shown(value: object) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def json_row(line: bytes, what: str, where: str) -> dict[str, object]:
    """One JSONL line as an object; errors say ``what`` and name ``where`` (file and line)."""
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{what}: {exc}", path=where) from exc
    if not isinstance(row, dict):
        raise ConfigError(f"{what}: a row must be a JSON object, got {shown(row)}", path=where)
    return row


def _present(row: dict[str, object], name: str, what: str, where: str) -> object:
    if name not in row:
        raise ConfigError(f"{what}: no {name}", path=where)
    return row[name]


def integer_field(row: dict[str, object], name: str, what: str, where: str) -> int:
    """A JSON integer, never converted: ``600.7``, ``"600"`` and ``true`` are not token counts."""
    value = _present(row, name, what, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what}: {name} must be an integer, got {shown(value)}", path=where)
    return value


def number_field(row: dict[str, object], name: str, what: str, where: str) -> float:
    """A finite JSON number (an integer is one); ``true`` and ``"5"`` are not."""
    value = _present(row, name, what, where)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{what}: {name} must be a finite number, got {shown(value)}", path=where)
    return float(value)


def text_field(row: dict[str, object], name: str, what: str, where: str) -> str | None:
    """An optional JSON string: absent or null is None, anything else (``7``) an error."""
    value = row.get(name)
    if not isinstance(value, str | None):
        raise ConfigError(f"{what}: {name} must be a string or null, got {shown(value)}", path=where)
    return value


def check_tokens(*counts: tuple[str, int], where: str) -> None:
    """Each named token count at least 1 and within :data:`MAX_TOKENS`."""
    for name, tokens in counts:
        if tokens < 1:
            raise ConfigError(f"{name} must be >= 1, got {tokens}", path=where)
        if tokens > MAX_TOKENS:
            raise ConfigError(f"{name} {tokens} is over the limit of {MAX_TOKENS} tokens", path=where)


def parse_row(line: bytes, where: str) -> MooncakeRow:
    """One JSONL line; errors name ``where`` (file and line) and the field."""
    what = "bad Mooncake trace line"
    row = json_row(line, what, where)
    stamp = number_field(row, "timestamp", what, where)
    input_length = integer_field(row, "input_length", what, where)
    output_length = integer_field(row, "output_length", what, where)
    hash_ids = _present(row, "hash_ids", what, where)
    if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
        raise ConfigError(f"{what}: hash_ids must be a list of integers, got {shown(hash_ids)}", path=where)
    check_tokens(("input_length", input_length), ("output_length", output_length), where=where)
    return MooncakeRow(stamp, input_length, output_length, tuple(hash_ids))


def prompt_text(builder: PromptBuilder, row: MooncakeRow, block_tokens: int, row_number: int,
                tail: str | None = None) -> str:  # fmt: skip
    """User-message text whose canonical chat bytes are exactly ``4 x input_length`` long.

    Blocks the row's ``hash_ids`` do not cover (a trace listing too few) get text unique to the row.
    ``tail`` is the key of the text that starts a partial last block (default: the row's own there).
    """
    length = max(1, row.input_length * BYTES_PER_TOKEN - USER_OVERHEAD)
    block_bytes = block_tokens * BYTES_PER_TOKEN
    parts: list[str] = []
    size = 0
    position = 0
    while size < length:
        take = min(block_bytes, length - size)
        parts.append(builder.block(_block_key(row, block_tokens, row_number, position, tail), take))
        size += take
        position += 1
    return "".join(parts)


def _block_key(row: MooncakeRow, block_tokens: int, row_number: int, position: int, tail: str | None) -> str:
    if tail is not None and position == row.input_length // block_tokens:
        return tail
    if position < len(row.hash_ids):
        return f"b{row.hash_ids[position]}"
    return f"row{row_number}-{position}"


class _Node:
    __slots__ = ("children", "conversations", "registrations")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.registrations: list[tuple[str, int]] = []  # (conversation, input + output tokens)
        self.conversations: set[str] = set()


def conversation_keys(rows: Sequence[MooncakeRow], block_tokens: int) -> list[str]:
    """One conversation key per row, in order (docs/bench.md states the rule).

    A row continues the conversation of an earlier row ``A`` when (a) ``A``'s full blocks (at least
    one) are a prefix of the row's ``hash_ids``, (b) the row is at least as long as ``A``'s prompt
    plus its answer (the next turn contains both), and (c) no other conversation's full blocks
    contain that prefix (then it is a shared prefix, such as a system prompt, not a conversation).
    The deepest such ``A`` wins, the latest on ties. Otherwise the row starts a conversation keyed
    ``mc-<row index>``.
    """
    root = _Node()
    keys: list[str] = []
    for index, row in enumerate(rows):
        full = min(len(row.hash_ids), row.input_length // block_tokens)
        node = root
        found: str | None = None
        for hash_id in row.hash_ids[:full]:
            child = node.children.get(hash_id)
            if child is None:
                break
            node = child
            if len(node.conversations) == 1:
                for conversation, needed in reversed(node.registrations):
                    if row.input_length >= needed:
                        found = conversation
                        break
        key = found or f"mc-{index}"
        keys.append(key)
        if full == 0:
            continue
        node = root
        for hash_id in row.hash_ids[:full]:
            node = node.children.setdefault(hash_id, _Node())
            if len(node.conversations) < 2:  # one or "shared" is all the rule needs
                node.conversations.add(key)
        node.registrations.append((key, row.input_length + row.output_length))
        del node.registrations[:-_MAX_REGISTRATIONS]
    return keys


def replay_requests(rows: Sequence[MooncakeRow], builder: PromptBuilder, block_tokens: int,
                    time_scale: float) -> list[TraceRequest]:  # fmt: skip
    """The rows as requests: prompts rebuilt, conversations keyed, turns numbered per conversation."""
    keys = conversation_keys(rows, block_tokens)
    tails = _grown_tails(rows, keys, block_tokens)
    start = min((row.timestamp_ms for row in rows), default=0.0)
    turns: dict[str, int] = {}
    out = []
    for index, (row, key) in enumerate(zip(rows, keys, strict=True)):
        turn = turns.get(key, 0)
        turns[key] = turn + 1
        text = prompt_text(builder, row, block_tokens, index, tails.get(index))
        out.append(TraceRequest((row.timestamp_ms - start) * time_scale, key, turn, row.input_length,
                                row.output_length, text))  # fmt: skip
    return out


def _grown_tails(rows: Sequence[MooncakeRow], keys: Sequence[str], block_tokens: int) -> dict[int, str]:
    """Row index -> the key of the text its partial last block has in its conversation's next row.

    Walked backwards, so a block that stays partial over several turns takes, in each, the text of
    the turn where it is last seen: every turn's text then starts with the whole of the turn before.
    """
    tails: dict[int, str] = {}
    following: dict[str, int] = {}
    for index in range(len(rows) - 1, -1, -1):
        row, key = rows[index], keys[index]
        after = following.get(key)
        following[key] = index
        if after is not None and row.input_length % block_tokens:
            position = row.input_length // block_tokens
            tails[index] = _block_key(rows[after], block_tokens, after, position, tails.get(after))
    return tails
