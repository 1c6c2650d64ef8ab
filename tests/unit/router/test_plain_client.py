"""Plain-client mode: which requests it touches, the input-token estimate of each OpenAI body, and
the cache-affinity key a body field gives."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from multidict import CIMultiDict

from stargate.bench.peers.tokenizer import write_tokenizer_dir
from stargate.errors import ConfigError, RequestError
from stargate.router.cli import build_parser, settings_from_args
from stargate.router.plain_client import (
    MAX_BODY_KEY_CHARS,
    BytesPerToken,
    PlainClients,
    PlainClientSettings,
    _json_object,
    body_key,
)
from stargate.wire.headers import text_value

SPEC_HEADERS = {"x-request-id": "r", "x-model": "m", "x-input-tokens": "5"}


def plain(**kw: object) -> PlainClients:
    return PlainClients(PlainClientSettings(**kw))  # type: ignore[arg-type]


def test_header_complete_requests_are_left_alone() -> None:
    clients = plain()
    assert not clients.incomplete(SPEC_HEADERS)
    assert not clients.incomplete({**SPEC_HEADERS, "x-session-id": "s", "x-cache-affinity-key": "k"})
    for name in SPEC_HEADERS:
        assert clients.incomplete({k: v for k, v in SPEC_HEADERS.items() if k != name})
    assert clients.incomplete({**SPEC_HEADERS, "x-model": "  "})
    assert clients.incomplete({**SPEC_HEADERS, "x-session-id": "s"})
    assert not plain(session_header=None).incomplete({**SPEC_HEADERS, "x-session-id": "s"})


def test_bytes_per_token_rounds_up() -> None:
    assert BytesPerToken(4).count("") == 0
    assert BytesPerToken(4).count("abcde") == 2
    assert BytesPerToken(4).count("é") == 1  # 2 UTF-8 bytes


def test_input_tokens_of_each_endpoint_body() -> None:
    clients = plain(bytes_per_token=1)
    chat = {"messages": [{"role": "system", "content": "abc"},
                         {"role": "user", "content": [{"type": "text", "text": "de"}]}]}
    assert clients.input_tokens(chat) == len("abc\nde")
    assert clients.input_tokens({"prompt": "hello"}) == 5
    assert clients.input_tokens({"prompt": [1, 2, 3]}) == 3  # pre-tokenized
    assert clients.input_tokens({"prompt": [[1, 2], [3]]}) == 3
    assert clients.input_tokens({"input": "abcd", "instructions": "xy"}) == len("abcd\nxy")
    assert clients.input_tokens({"input": ["a", "b"]}) == len("a\nb")
    assert clients.input_tokens({"model": "m"}) == 1  # never 0
    # An assistant turn's tool calls (44 KB of arguments counted as 3 tokens).
    call = {"id": "c1", "type": "function", "function": {"name": "write", "arguments": '{"a":1}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert clients.input_tokens({"messages": [turn]}) == len('{"a":1}')
    legacy = {"role": "assistant", "function_call": {"name": "write", "arguments": "xyz"}}
    assert clients.input_tokens({"messages": [legacy]}) == 3


def test_tool_definitions_count_in_the_prompt_but_do_not_key_it() -> None:
    """An agent's 37 KB of tool schemas beside a short message was estimated at 4 tokens."""
    clients = plain(bytes_per_token=1)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    size = len("type function function name parameters f type object")  # every name and value
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert clients.input_tokens({**chat, "tools": tools}) == len("hi") + size
    assert clients.input_tokens({**chat, "functions": tools}) == len("hi") + size
    assert clients.input_tokens({**chat, "tools": []}) == len("hi")
    deep: dict[str, object] = {"type": "string"}
    for _ in range(600):  # past orjson's 255 levels (a 500 before), within the parser's 1 024
        deep = {"items": deep}
    words = " ".join(["items"] * 600 + ["type string"])
    assert clients.input_tokens({**chat, "tools": [deep]}) == len("hi") + len(words)
    long = {"messages": [{"role": "user", "content": "x" * 600}]}
    first = _key(clients, long)
    assert first is not None and _key(clients, {**long, "tools": tools}) is None  # the same text: a repeat


def test_prompts_nested_as_deep_as_json_allows_are_counted_in_order() -> None:
    clients = plain(bytes_per_token=1)
    deep = orjson.loads(b"[" * 1000 + b'"abc"' + b"]" * 1000)  # orjson's limit is 1024 levels
    assert clients.input_tokens({"messages": deep}) == 3
    nested = {"role": "user", "content": [{"text": "ab"}, {"content": [{"text": "cd"}, [7, 8]]}, "ef"]}
    assert clients.input_tokens({"messages": [nested]}) == len("ab\ncd\nef") + 2  # 2 token ids


def test_a_configured_tokenizer_counts_the_prompt(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    directory = write_tokenizer_dir(tmp_path / "tok", "m")  # one token per UTF-8 byte
    clients = plain(tokenizer_path=str(directory))
    assert clients.input_tokens({"prompt": "hello world"}) == 11
    assert plain(tokenizer_path=str(directory / "tokenizer.json")).input_tokens({"prompt": "é"}) == 2


def test_an_unloadable_tokenizer_names_the_flag(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    with pytest.raises(ConfigError, match="--plain-client-tokenizer"):
        plain(tokenizer_path=str(tmp_path / "missing.json"))


def test_cli_mode_flags() -> None:
    base = ["--stargate-id", "s", "--advertise-addr", "127.0.0.1:1", "--disable-dns-discovery"]
    assert settings_from_args(build_parser({}).parse_args(base)).plain_clients is None
    on = settings_from_args(build_parser({}).parse_args([*base, "--plain-clients"])).plain_clients
    assert on == PlainClientSettings()
    from_env = build_parser({"STARGATE_PLAIN_CLIENTS": "true"}).parse_args(base)
    assert settings_from_args(from_env).plain_clients is not None
    flags = ["--plain-clients", "true", "--plain-client-session-header", ""]
    flags += ["--plain-client-bytes-per-token", "3", "--plain-client-prefix-keys", "false"]
    tuned = settings_from_args(build_parser({}).parse_args([*base, *flags])).plain_clients
    assert tuned == PlainClientSettings(bytes_per_token=3, session_header=None, prefix_keys=False)
    bad = build_parser({}).parse_args([*base, "--plain-clients", "--plain-client-session-header", "a b"])
    with pytest.raises(ConfigError, match="--plain-client-session-header"):
        settings_from_args(bad)
    small = [*base, "--plain-clients", "--plain-client-max-body-bytes", "1000"]
    assert settings_from_args(
        build_parser({}).parse_args([*small, "--proxy-max-buffered-body-bytes", "1000"])
    ).proxy.max_buffered_body_bytes == 1000
    too_small = build_parser({}).parse_args([*small, "--proxy-max-buffered-body-bytes", "999"])
    with pytest.raises(ConfigError, match="--proxy-max-buffered-body-bytes"):  # a body is read whole
        settings_from_args(too_small)


def test_a_short_visible_ascii_key_is_sent_as_given() -> None:
    assert body_key("  conversation-1 ") == "conversation-1"
    assert body_key("k" * MAX_BODY_KEY_CHARS) == "k" * MAX_BODY_KEY_CHARS
    for blank_or_not_text in ("", " \t\n", None, 7, ["k"], {"k": "v"}, True):
        assert body_key(blank_or_not_text) is None


@pytest.mark.parametrize(
    "value", ["k" * (MAX_BODY_KEY_CHARS + 1), "jos\u00e9", "\u4f1a\u8bdd", "a\r\nx-injected: 1", "a\x00b"]
)
def test_a_long_or_non_ascii_key_is_sent_as_its_digest(value: str) -> None:
    """Still one key per value (its requests stay together), and a header value every hop accepts."""
    key = body_key(value)
    assert key is not None and key.startswith("sha256:") and len(key) == 71
    assert text_value(key) == key
    assert body_key(f" {value} ") == key != body_key(value + "2")


def _key(clients: PlainClients, body: dict[str, object], path: str = "/v1/chat/completions") -> str | None:
    headers = CIMultiDict({"x-request-id": "r"})
    clients._fill(headers, {"model": "m", **body}, path)
    return headers.get("x-cache-affinity-key")


def test_a_body_without_a_key_field_gets_the_key_of_the_turn_it_continues() -> None:
    clients = plain()
    history = [{"role": "system", "content": "s" * 600}, {"role": "user", "content": "first"}]
    first = _key(clients, {"messages": history})
    assert first is not None and first.startswith("prefix:")
    history += [{"role": "assistant", "content": "answer"}, {"role": "user", "content": "second"}]
    assert _key(clients, {"messages": history}) == first
    # prompt_cache_key wins and its request is not remembered as a turn.
    keyed = [*history, {"role": "user", "content": "x"}]
    assert _key(clients, {"messages": keyed, "prompt_cache_key": "c"}) == "c"
    assert _key(clients, {"messages": keyed}) == first  # not a repeat: it continues the turn before
    # Too short to be worth a key.
    assert _key(clients, {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert _key(plain(prefix_keys=False), {"messages": history}) is None


def test_one_user_for_every_conversation_does_not_make_them_one_key() -> None:
    """An app that sends one ``user`` for all its users: each conversation keeps a key of its own,
    and ``user`` keys only what the text gives none (a short prompt, a repeat) and a request
    chained by ``previous_response_id``, whose text the router cannot follow."""
    clients = plain()
    system = {"role": "system", "content": "s" * 600}
    chats = [[system, {"role": "user", "content": f"chat {n}"}] for n in range(3)]
    keys = [_key(clients, {"messages": chat, "user": "acme-webapp"}) for chat in chats]
    assert len(set(keys)) == 3 and "acme-webapp" not in keys
    grown = [*chats[1], {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    assert _key(clients, {"messages": grown, "user": "acme-webapp"}) == keys[1]
    assert _key(clients, {"messages": chats[0], "user": "acme-webapp"}) == "acme-webapp"  # a repeat
    short = {"messages": [{"role": "user", "content": "hi"}], "user": "acme-webapp"}
    assert _key(clients, short) == "acme-webapp"
    # A stored Responses chain keeps one key from its first turn (which does not say it starts one).
    first_turn = {"instructions": "i" * 2000, "input": "hello", "user": "end-user-7"}
    assert _key(clients, first_turn, "/v1/responses") == "end-user-7"
    chained = {"input": "x" * 600, "previous_response_id": "resp_1", "user": "end-user-7"}
    assert _key(clients, chained, "/v1/responses") == "end-user-7"
    assert _key(clients, {**first_turn, "store": False}, "/v1/responses") != "end-user-7"
    assert _key(plain(prefix_keys=False), {"messages": grown, "user": "u"}) == "u"


def test_responses_instructions_come_first_so_a_growing_input_continues() -> None:
    clients = plain()
    instructions = "be brief " * 100
    first = _key(clients, {"instructions": instructions, "input": [{"role": "user", "content": "q1"}]})
    grown = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}]  # fmt: skip
    assert _key(clients, {"instructions": instructions, "input": grown}) == first


@pytest.mark.parametrize(
    ("model", "says"),
    [("mock-model\n", "not a model id"), ("\u00fc-model", "not a model id"), ("  ", "names no model"),
     (7, "names no model")],
)  # fmt: skip
def test_a_model_that_cannot_travel_as_a_header_is_named_not_missing(model: object, says: str) -> None:
    with pytest.raises(RequestError) as raised:
        plain()._fill(CIMultiDict({"x-request-id": "r"}), {"model": model})
    assert says in raised.value.message


@pytest.mark.parametrize(
    ("body", "says"),
    [(b"{", "is not valid JSON"), (b"\xff\xfe", "is not valid JSON"), (b"[1]", "must be a JSON object")],
)
def test_a_body_that_is_not_a_json_object_says_which_it_is(body: bytes, says: str) -> None:
    with pytest.raises(RequestError) as raised:
        _json_object(body, None, 1000)
    assert says in raised.value.message and "x-model or x-input-tokens is missing" in raised.value.message
