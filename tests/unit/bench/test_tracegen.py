"""The synthetic Mooncake-format trace generator: deterministic, and shaped as documented."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from stargate.bench.cli import main
from stargate.bench.mooncake import MooncakeRow, conversation_keys
from stargate.bench.tracegen import TraceRow, TraceShape, generate_trace, write_trace

SHAPE = TraceShape(conversations=60, system_prompts=2, system_tokens=1536, max_turns=4)


def by_conversation(rows: list[TraceRow]) -> dict[int, list[TraceRow]]:
    groups: dict[int, list[TraceRow]] = defaultdict(list)
    for row in rows:
        groups[row.conversation].append(row)
    return groups


def test_same_seed_same_trace_other_seed_other_trace(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_trace(first, generate_trace(SHAPE, 7))
    write_trace(second, generate_trace(SHAPE, 7))
    assert first.read_bytes() == second.read_bytes()
    assert generate_trace(SHAPE, 8) != generate_trace(SHAPE, 7)
    line = orjson.loads(first.read_bytes().splitlines()[0])
    assert set(line) == {"timestamp", "input_length", "output_length", "hash_ids"}


def test_rows_are_sorted_and_blocks_cover_the_prompt() -> None:
    rows = generate_trace(SHAPE, 1)
    assert [r.timestamp_ms for r in rows] == sorted(r.timestamp_ms for r in rows)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in rows)
    assert all(r.input_length <= SHAPE.max_input_tokens for r in rows)


def test_turns_extend_the_previous_prompt() -> None:
    groups = by_conversation(generate_trace(SHAPE, 2))
    multi = [turns for turns in groups.values() if len(turns) > 1]
    assert len(multi) > 10
    for turns in multi:
        for before, after in itertools.pairwise(turns):
            assert after.timestamp_ms - before.timestamp_ms >= SHAPE.min_think_s * 1000 - 1
            assert after.input_length > before.input_length + before.output_length
            full = before.input_length // 512
            assert after.hash_ids[:full] == before.hash_ids[:full]


def test_system_prompts_are_shared_across_conversations() -> None:
    rows = generate_trace(SHAPE, 3)
    first_blocks = {r.hash_ids[0] for r in rows}
    assert len(first_blocks) == SHAPE.system_prompts  # every prompt starts inside a system prompt
    firsts = [turns[0] for turns in by_conversation(rows).values()]
    assert len({r.hash_ids[1] for r in firsts}) <= SHAPE.system_prompts  # a second shared block


def test_bursts_start_more_conversations() -> None:
    shape = TraceShape(conversations=400, burst_factor=8.0, burst_period_s=20.0, burst_s=4.0)
    starts = [turns[0].timestamp_ms / 1000 for turns in by_conversation(generate_trace(shape, 4)).values()]
    inside = sum(1 for t in starts if t % 20.0 < 4.0)
    # 4 s at rate 8 against 16 s at rate 1 per period: about two thirds start inside a burst
    assert inside / len(starts) > 0.5


# The default shape, and trace-system-prompts' (long system prompts, up to 8 turns), where a first
# turn whose full blocks are all system prompt once gave 98 requests of many conversations one key.
@pytest.mark.parametrize(
    ("shape", "seed"),
    [
        (TraceShape(), 5),
        (TraceShape(conversations=200, max_turns=8, system_tokens=3000, first_user_tokens=1500,
                    turn_user_tokens=300, conversation_rate=1.5), 21),
    ],
)  # fmt: skip
def test_conversation_keys_mostly_recover_the_generated_conversations(shape: TraceShape, seed: int) -> None:
    rows = generate_trace(shape, seed)
    keys = conversation_keys(
        [MooncakeRow(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in rows], 512
    )
    conversations_of_key: dict[str, set[int]] = defaultdict(set)
    later_keys: dict[int, set[str]] = defaultdict(set)
    for row, key in zip(rows, keys, strict=True):
        conversations_of_key[key].add(row.conversation)
        if row.turn >= 1:
            later_keys[row.conversation].add(key)
    merged = sum(1 for found in conversations_of_key.values() if len(found) > 1)
    assert merged <= 0.05 * len(conversations_of_key)  # a key rarely spans two conversations
    assert max(len(found) for found in conversations_of_key.values()) <= 2  # and never many
    # a first turn with no full block of its own may keep a key of its own; later turns share one
    kept = sum(1 for found in later_keys.values() if len(found) == 1)
    assert len(later_keys) > 50 and kept >= 0.95 * len(later_keys)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--min-think-s", "inf"], "--min-think-s: must be at most 86400, got inf"),
        (["--min-think-s", "1e306"], "--min-think-s: must be at most 86400"),
        (["--mean-extra-think-s", "inf"], "--mean-extra-think-s: must be at most 86400"),
        (["--conversation-rate", "1e-320"], "--conversation-rate: must be at least"),
        (["--output-tokens", "5000000"], "--output-tokens: must be at most 1000000, got 5000000"),
        (["--max-input-tokens", "1000001"], "--max-input-tokens: must be at most 1000000"),
        (["--max-input-tokens", "10"], "--max-input-tokens: no conversation's first prompt fits in 10"),
    ],
)
def test_flags_a_replay_could_not_take_are_usage_errors(
    tmp_path: Path, flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["gen-trace", "--out", str(out), *flags]) == 2
    assert f"error: {error}" in capsys.readouterr().out
    assert not out.exists()


def test_the_summary_counts_the_conversations_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    flags = ["--conversations", "50", "--max-input-tokens", "3000", "--output-tokens", "600000"]
    assert main(["gen-trace", "--out", str(out), *flags]) == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert all(row["output_length"] <= 1_000_000 for row in rows)
    conversations = len(by_conversation(generate_trace(TraceShape(conversations=50, max_input_tokens=3000,
                                                                    output_tokens=600000), 0)))  # fmt: skip
    assert 0 < conversations < 50
    assert f"wrote {len(rows)} requests of {conversations} conversations" in capsys.readouterr().out


@pytest.mark.parametrize(("factor", "burst_s"), [(5.0, 6.0), (20.0, 2.0)])
def test_the_start_rate_inside_bursts_is_the_burst_factor_times_the_quiet_rate(
    factor: float, burst_s: float
) -> None:
    shape = TraceShape(
        conversations=4000, max_turns=1, burst_factor=factor, burst_s=burst_s, burst_period_s=30.0
    )
    starts = [row.timestamp_ms / 1000 for row in generate_trace(shape, 5)]
    periods = max(starts) / 30.0
    inside = sum(1 for t in starts if t % 30.0 < burst_s)
    ratio = (inside / (periods * burst_s)) / ((len(starts) - inside) / (periods * (30.0 - burst_s)))
    assert 0.9 * factor < ratio < 1.1 * factor  # a quiet gap running over the burst gave 4.1 and 10.8
