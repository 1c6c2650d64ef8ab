"""Mooncake trace rows: parsing, prompts rebuilt block by block, conversation keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from stargate.bench.mooncake import MooncakeRow, conversation_keys, parse_row, prompt_text, replay_requests
from stargate.bench.prompts import PromptBuilder, prompt_bytes_length
from stargate.errors import ConfigError


def row(input_length: int, hash_ids: tuple[int, ...], output_length: int = 100) -> MooncakeRow:
    return MooncakeRow(0.0, input_length, output_length, hash_ids)


def test_parse_row_and_errors_name_the_line() -> None:
    line = b'{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}'
    assert parse_row(line, "t.jsonl:1") == MooncakeRow(27482.0, 6955, 52, (46, 47))
    with pytest.raises(ConfigError, match="input_length") as missing:
        parse_row(b'{"timestamp": 1, "output_length": 2, "hash_ids": []}', "t.jsonl:7")
    assert "t.jsonl:7" in missing.value.describe()
    with pytest.raises(ConfigError, match=">= 1"):
        parse_row(b'{"timestamp": 1, "input_length": 0, "output_length": 2, "hash_ids": []}', "x")


def test_same_hash_ids_give_the_same_block_text() -> None:
    builder = PromptBuilder(seed=3)
    first = prompt_text(builder, row(1024, (1, 2)), 512, 0)
    second = prompt_text(PromptBuilder(seed=3), row(700, (1, 3)), 512, 1)
    block = 512 * 4
    assert first[:block] == second[:block]  # block 1: 512 tokens of 4 bytes
    assert first[block : block + 16] != second[block : block + 16]  # blocks 2 and 3 differ at once
    longer = prompt_text(builder, row(1600, (1, 2, 9, 10)), 512, 2)
    assert longer.startswith(first)  # a turn extending the previous prompt extends its text


def test_prompt_length_matches_the_token_count() -> None:
    builder = PromptBuilder(seed=0)
    for tokens in (1, 511, 512, 1300):
        text = prompt_text(builder, row(tokens, (4, 5, 6)), 512, 0)
        assert prompt_bytes_length([{"role": "user", "content": text}]) == max(4 * tokens, 7)


def test_blocks_beyond_the_listed_hash_ids_are_unique_to_the_row() -> None:
    builder = PromptBuilder(seed=0)
    one = prompt_text(builder, row(1024, (1,)), 512, 0)
    two = prompt_text(builder, row(1024, (1,)), 512, 1)
    assert one[:2048] == two[:2048] and one[2048:] != two[2048:]


def test_conversation_keys_follow_turns_and_skip_shared_prefixes() -> None:
    rows = [
        row(600, (1, 2)),  # A: one full block [1]
        row(1100, (1, 3, 4)),  # A's next turn: contains [1], long enough for A + its answer
        row(650, (1, 5)),  # too short to contain A's prompt and answer: a new conversation on [1]
        row(2000, (1, 6, 7, 8)),  # [1] now ends prompts of two conversations: shared, new again
        row(1400, (1, 3, 9)),  # contains A's second turn's full blocks [1, 3]: A
        row(300, (1,)),  # no full block: always its own key
    ]
    assert conversation_keys(rows, 512) == ["mc-0", "mc-0", "mc-2", "mc-3", "mc-0", "mc-5"]


def test_a_short_prompt_on_a_block_every_row_shares_is_no_conversation_to_join() -> None:
    # As in the public conversation trace: every row starts with block 0. A one-block prompt ends on
    # it first; the rows after it share only that block and are conversations of their own.
    rows = [
        row(6000, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)),
        row(900, (0, 12)),  # its only full block is the one every row has
        row(4000, (0, 13, 14, 15, 16, 17, 18, 19)),
        row(3000, (0, 20, 21, 22, 23, 24)),
        row(7000, (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 25, 26)),  # the first row's next turn
    ]
    assert conversation_keys(rows, 512) == ["mc-0", "mc-1", "mc-2", "mc-3", "mc-0"]


def test_each_turn_starts_with_the_whole_prompt_of_the_turn_before() -> None:
    # A's partial second block [2] grew into [3] in its next turn: the text it grew from is [3]'s start.
    rows = [row(600, (1, 2)), row(1100, (1, 3, 4)), row(1700, (1, 3, 4, 5)), row(650, (1, 7))]
    first, second, third, other = replay_requests(rows, PromptBuilder(seed=1), 512, 1.0)
    assert first.conversation == second.conversation == third.conversation != other.conversation
    assert second.prompt.startswith(first.prompt) and third.prompt.startswith(second.prompt)
    assert not other.prompt.startswith(first.prompt[: 512 * 4 + 8])  # [7], not [3]: its own text
    # The last turn's partial block is its own: nothing follows it.
    assert third.prompt == prompt_text(PromptBuilder(seed=1), rows[2], 512, 2)


def test_a_block_partial_over_several_turns_keeps_each_turn_a_prefix_of_the_next() -> None:
    # Block 2 is partial in the first two turns ([12], then [13]) and full in the third ([14]).
    rows = [row(1100, (10, 11, 12), 20), row(1520, (10, 11, 13), 20), row(2140, (10, 11, 14, 15, 16), 20)]
    first, second, third = replay_requests(rows, PromptBuilder(seed=3), 512, 1.0)
    assert first.conversation == second.conversation == third.conversation
    assert second.prompt.startswith(first.prompt) and third.prompt.startswith(second.prompt)


@pytest.mark.parametrize(
    "name", ["synthetic-conversations", "system-prompt-conversations", "mooncake-conversation-trace-head"]
)
def test_every_continuation_in_the_shipped_traces_starts_with_its_predecessor(name: str) -> None:
    path = Path(__file__).resolve().parents[3] / "benches" / "traces" / f"{name}.jsonl"
    rows = [parse_row(line, name) for line in path.read_bytes().splitlines() if line.strip()]
    requests = replay_requests(rows, PromptBuilder(seed=13), 512, 1.0)
    previous: dict[str, int] = {}
    continuations = 0
    for index, request in enumerate(requests):
        before = previous.get(request.conversation)
        previous[request.conversation] = index
        if (
            before is None
            or rows[index].input_length < rows[before].input_length + rows[before].output_length
        ):
            continue  # a conversation's first turn, or a branch off an earlier turn
        continuations += 1
        assert request.prompt.startswith(requests[before].prompt), (before, index)
    assert continuations > 50


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ('"hash_ids": "12"', "hash_ids"),
        ('"hash_ids": {"7": 1, "8": 2}', "hash_ids"),
        ('"hash_ids": [1.9, 2.2]', "hash_ids"),
        ('"hash_ids": [true, false]', "hash_ids"),
        ('"hash_ids": ["1", "2"]', "hash_ids"),
        ('"hash_ids": null', "hash_ids"),
        ('"input_length": 600.7', "input_length"),
        ('"input_length": "600"', "input_length"),
        ('"input_length": null', "input_length"),
        ('"output_length": true', "output_length"),
        ('"timestamp": true', "timestamp"),
        ('"timestamp": "5"', "timestamp"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_converted(changed: str, field: str) -> None:
    good = {"timestamp": "1", "input_length": "600", "output_length": "10", "hash_ids": "[1, 2]"}
    name = changed.split('"')[1]
    fields = ", ".join(f'"{key}": {value}' for key, value in good.items() if key != name)
    with pytest.raises(ConfigError, match=f"{field} must be") as error:
        parse_row(f"{{{fields}, {changed}}}".encode(), "t.jsonl:2")
    assert error.value.path == "t.jsonl:2"
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_row(b"[1, 2]", "t.jsonl:2")
