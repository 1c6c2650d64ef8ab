from __future__ import annotations

import orjson

from stargate.mock_engine import tokens as tok


def test_s9_10_header_output_tokens_may_exceed_default() -> None:
    assert tok.output_tokens(64, 16, 8) == 64


def test_s9_11_max_tokens_cannot_lengthen_default() -> None:
    assert tok.output_tokens(None, 128, 8) == 8
    assert tok.output_tokens(None, 3, 8) == 3
    assert tok.output_tokens(None, None, 0) == 1


def test_s9_12_zero_output_tokens_become_one() -> None:
    assert tok.output_tokens(None, 0, 8) == 1
    assert tok.output_tokens(0, None, 8) == 1


def test_s9_14_chat_input_estimate_bytes_and_floor() -> None:
    assert tok.chat_input_estimate([{"content": "hello world"}]) == 11
    assert tok.chat_input_estimate([]) == 1
    assert tok.chat_input_estimate([{"content": [{"type": "text"}]}, {"content": "a"}]) == 2


def test_s9_15_header_parsing_is_strict() -> None:
    assert tok.parse_token_header("0") == 0
    assert tok.parse_token_header("11") == 11
    assert tok.parse_token_header(" 11") is None
    assert tok.parse_token_header("-1") is None
    assert tok.parse_token_header(None) is None


def test_token_headers_out_of_u64_range_are_unparsable_not_an_error() -> None:
    assert tok.parse_token_header("0" * 5000 + "7") == 7  # 5 001 digits: past int()'s limit
    assert tok.parse_token_header("9" * 5000) is None
    assert tok.parse_token_header(str(2**64 - 1)) == 2**64 - 1
    assert tok.parse_token_header(str(2**64)) is None


def test_s9_17_responses_input_estimates() -> None:
    assert tok.responses_input_estimate(None) == 1
    assert tok.responses_input_estimate("hello") == 5
    assert tok.responses_input_estimate(["hi", {"x": 1}]) == 9
    assert tok.responses_input_estimate({"x": 1}) == 7


def test_s9_20_embedding_item_counts() -> None:
    cases = [("single input", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1, 2], [3, 4], [5]], 3), ([], 0)]
    for value, expected in cases:
        assert tok.embeddings_item_count(value) == expected


def test_s9_21_embedding_prompt_token_estimates() -> None:
    cases = [
        ("abcd", 4), ([1, 2, 3], 3), (["alpha", "b"], 6), ([[1, 2], [3, 4], [5]], 5),
        (["abc", [1, 2], True], 6), ({"unexpected": True}, 1), (["", "b"], 2), ([[], [1, 2]], 3),
    ]  # fmt: skip
    for value, expected in cases:
        assert tok.embeddings_input_estimate(value) == expected, value


def test_prefix_prompt_bytes_share_leading_messages() -> None:
    system = {"role": "system", "content": "You are terse."}
    a = tok.chat_prompt_bytes([system, {"role": "user", "content": "one"}])
    b = tok.chat_prompt_bytes([system, {"role": "user", "content": "two"}])
    common = tok.chat_prompt_bytes([system])
    assert a.startswith(common) and b.startswith(common) and a != b


def test_text_token_estimate_rounds_up_four_bytes_per_token() -> None:
    assert tok.text_token_estimate(b"") == 1
    assert tok.text_token_estimate(b"abcd") == 1
    assert tok.text_token_estimate(b"abcde") == 2


def test_prompt_text_nested_as_deep_as_json_allows_is_read_in_order() -> None:
    deep = orjson.loads(b"[" * 1000 + b'"abc"' + b"]" * 1000)  # orjson's limit is 1024 levels
    assert tok.raw_prompt_bytes(deep) == b"abc"
    content = [{"text": "ab"}, {"content": ["cd", {"text": "ef"}]}, "gh"]
    assert tok.chat_prompt_bytes([{"role": "user", "content": content}]) == b"user\x00abcdefgh\x00"
