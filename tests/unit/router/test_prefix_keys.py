"""Keys from prompt text: a prompt that starts with a whole earlier prompt continues it; nothing else does."""

from __future__ import annotations

import pytest

from stargate.router import prefix_keys
from stargate.router.prefix_keys import BLOCK_CHARS, KEY_PREFIX, MAX_DIGESTS, PrefixKeys

SYSTEM = "You are a helpful assistant. " * 40  # 1 160 characters: two whole blocks


def test_a_prompt_shorter_than_a_block_gets_no_key_and_is_not_remembered() -> None:
    keys = PrefixKeys()
    assert keys.key("") is None
    assert keys.key("x" * (BLOCK_CHARS - 1)) is None
    assert len(keys) == 0


def test_each_turn_of_a_conversation_gets_the_key_of_the_turn_before() -> None:
    keys = PrefixKeys()
    turn = SYSTEM + "\nfirst question"
    first = keys.key(turn)
    assert first is not None and first.startswith(KEY_PREFIX)
    assert keys.key(turn) is None  # the same prompt again: a repeat, placed by load
    for n in range(5):
        turn += f"\nan answer\nquestion {n} " + "context " * n * 30
        assert keys.key(turn) == first


def test_prompts_that_share_a_system_prompt_and_differ_after_it_are_not_one_conversation() -> None:
    keys = PrefixKeys()
    first = keys.key(SYSTEM + "\nwhat is the capital of France?")
    second = keys.key(SYSTEM + "\nhow tall is Everest?")
    assert first is not None and second is not None and first != second
    # Differing only in a tail shorter than a block: still apart (the whole prompt is compared).
    third = keys.key(SYSTEM + "\nhow tall is K2?")
    assert third not in (first, second)
    # Each continues on its own.
    assert keys.key(SYSTEM + "\nhow tall is Everest?\n8849 m\nand K2?") == second


def test_copies_of_one_prompt_get_no_key_and_its_continuation_the_first_ones() -> None:
    keys = PrefixKeys()
    first = keys.key(SYSTEM)
    assert first is not None
    assert [keys.key(SYSTEM) for _ in range(3)] == [None, None, None]
    assert keys.key(SYSTEM + "\nnext") == first


def test_a_shorter_prompt_does_not_continue_a_longer_one() -> None:
    keys = PrefixKeys()
    long = keys.key(SYSTEM + "\nfirst question\nanswer\nsecond question")
    assert keys.key(SYSTEM + "\nfirst question") != long


def test_the_longest_earlier_prompt_wins() -> None:
    keys = PrefixKeys()
    opening = keys.key(SYSTEM)
    assert keys.key(SYSTEM + "\nquestion") == opening
    # A second conversation that started elsewhere, then one that continues it.
    other = "another system prompt. " * 40
    assert keys.key(other) != opening


def test_memory_is_bounded_and_forgets_the_least_recent_first() -> None:
    keys = PrefixKeys(capacity=2)
    prompts = [f"{n} " + "words " * 120 for n in range(3)]
    first, _, third = (keys.key(p) for p in prompts)
    assert len(keys) == 2
    assert keys.key(prompts[0] + " more") != first  # forgotten: a key of its own
    assert keys.key(prompts[2] + " more") == third


def test_the_bound_counts_prompts_and_forgets_them_one_by_one() -> None:
    """Prompts that end in one block go one at a time, the least recently seen first, not the
    block's all at once."""
    keys = PrefixKeys(capacity=3)
    prompts = [SYSTEM + f"\nq{n:02d}" for n in range(4)]  # one last block, tails differ
    found = [keys.key(p) for p in prompts]
    assert len(keys) == 3
    assert keys.key(prompts[0] + "\nmore") != found[0]  # forgotten: a key of its own
    assert keys.key(prompts[3] + "\nmore") == found[3]


def test_every_conversation_of_a_shared_system_prompt_keeps_its_key() -> None:
    """Thousands of chats whose first turns end in the system prompt's last block: each next turn
    still finds its own first one (a block held its newest 16, and every other chat moved)."""
    keys = PrefixKeys()
    firsts = [SYSTEM + f"\nhello from chat {n:04d}" for n in range(2000)]
    found = [keys.key(p) for p in firsts]
    assert len(set(found)) == len(firsts)
    seconds = [p + f"\nan answer\nand then {n}?" for n, p in enumerate(firsts)]
    assert [keys.key(p) for p in seconds] == found


def test_the_longest_earlier_prompt_in_a_block_wins() -> None:
    keys = PrefixKeys()
    short = keys.key(SYSTEM + "\nq")
    keys.key("another system prompt. " * 40)
    assert keys.key(SYSTEM + "\nq\nmore") == short  # continued: the conversation goes on
    longer = keys.key(SYSTEM + "\nq\nmore")  # a repeat, no key
    assert longer is None
    assert keys.key(SYSTEM + "\nq\nmore\nand more") == short  # the longer earlier prompt, same key


def test_a_lookup_computes_a_bounded_number_of_digests_whatever_was_planted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts that share a text's blocks and last characters at every length, but not the text,
    made a lookup compute a digest per remembered length (20 ms of the event loop for 8 KB)."""
    text = SYSTEM + "abcdefghij" * 100
    keys = PrefixKeys()
    edge = 2 * BLOCK_CHARS  # the planted prompts differ from the text right after this block
    for length in range(edge + 16, 3 * BLOCK_CHARS):
        keys.key(text[:edge] + "Z" + text[edge + 1 : length])
    calls = 0
    digest = prefix_keys._digest

    def counted(prefix: bytes, tail: str) -> bytes:
        nonlocal calls
        calls += 1
        return digest(prefix, tail)

    monkeypatch.setattr(prefix_keys, "_digest", counted)
    assert keys.key(text) is not None  # a key of its own
    chain = len(text) // BLOCK_CHARS
    assert calls <= chain + 1 + MAX_DIGESTS


def test_non_ascii_and_lone_surrogates_are_hashed() -> None:
    keys = PrefixKeys()
    text = "日本語のプロンプト。" * 60 + "\ud800"
    key = keys.key(text)
    assert key is not None and keys.key(text + "続き") == key


def test_a_prompt_continued_a_second_way_is_a_shared_opening_not_a_conversation() -> None:
    """A template's system prompt sent alone once (a warm-up, a probe) must not make every later
    request of the template one conversation, held on one replica."""
    keys = PrefixKeys()
    opening = keys.key(SYSTEM)
    first = keys.key(SYSTEM + "\nwhat is the capital of France?")
    assert first == opening  # continued once: it may be a conversation
    later = [keys.key(SYSTEM + f"\nquestion {n}") for n in range(5)]
    assert len({opening, *later}) == 6  # a second way: each request is its own
    # Each still continues on its own, the first one too.
    assert keys.key(SYSTEM + "\nquestion 3\nan answer\nmore") == later[3]
    assert keys.key(SYSTEM + "\nwhat is the capital of France?\nParis\nand Spain?") == first


def test_a_repeated_turn_does_not_count_as_a_second_continuation() -> None:
    keys = PrefixKeys()
    turn = SYSTEM + "\nfirst question"
    first = keys.key(turn)
    turn += "\nan answer\nsecond question"
    assert keys.key(turn) == first
    assert keys.key(turn) is None  # the client retried it
    assert keys.key(turn + "\nanother answer\nthird question") == first
