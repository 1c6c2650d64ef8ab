from __future__ import annotations

import orjson

from stargate.mock_engine import openai_format as fmt
from stargate.wire.limits import U64_MAX


def events(data: bytes) -> list[bytes]:
    return [part for part in data.split(b"\n\n") if part]


def test_s9_7_two_token_stream_sequence_without_usage() -> None:
    stream = fmt.ChatStream("id-1", "m", "fp", 1, include_usage=False)
    body = stream.token(0) + stream.token(1) + stream.finish(7, 2)
    frames = events(body)
    assert frames[-1] == b"data: [DONE]"
    chunks = [orjson.loads(frame.removeprefix(b"data: ")) for frame in frames[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert deltas == [{"role": "assistant"}, {"content": "Hello"}, {"content": ","}, {}]
    assert b"usage" not in body
    assert chunks[0]["system_fingerprint"] == "fp" and chunks[0]["object"] == "chat.completion.chunk"


def test_s9_8_stop_chunk_and_content_finish_reasons() -> None:
    stream = fmt.ChatStream("id-1", "m", "fp", 1, include_usage=False)
    content = orjson.loads(events(stream.token(3))[0].removeprefix(b"data: "))
    stop = orjson.loads(events(stream.finish(1, 1))[0].removeprefix(b"data: "))
    assert content["choices"][0]["finish_reason"] is None
    assert stop["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "stop"}


def test_include_usage_adds_final_usage_chunk() -> None:
    stream = fmt.ChatStream("id-1", "m", "fp", 1, include_usage=True)
    frames = events(stream.finish(11, 3))
    usage = orjson.loads(frames[1].removeprefix(b"data: "))
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
    }  # fmt: skip


def test_s9_9_non_streaming_body_usage_and_content() -> None:
    body = fmt.chat_body("id", "m", "fp", 1, 11, 3)
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    assert body["choices"][0]["message"]["content"] == "Hello, how"


def test_s9_13_tokens_cycle_after_thirty() -> None:
    assert [fmt.token_text(i) for i in range(30, 35)] == ["Hello", ",", " how", " can", " I"]
    assert fmt.content(35) == fmt.content(30) + "Hello, how can I"


def test_s9_22_embedding_encodings() -> None:
    floats = fmt.embeddings_body("m", 2, 3, base64=False)
    assert [item["embedding"] for item in floats["data"]] == [[0.0, 0.125, -0.25], [1.0, 1.125, -1.25]]
    encoded = fmt.embeddings_body("m", 2, 3, base64=True)
    assert {item["embedding"] for item in encoded["data"]} == {"AAAAAAAAAAA="}


def test_responses_stream_events() -> None:
    stream = fmt.ResponsesStream("resp-1", "m", 5)
    frames = [*events(stream.preamble()), stream.token(0), stream.token(1), *events(stream.finish(7, 2))]
    parsed = [orjson.loads(frame.split(b"data: ", 1)[1]) for frame in frames]
    assert [event["type"] for event in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [event["sequence_number"] for event in parsed] == list(range(10))
    assert [frame.split(b"\n", 1)[0].removeprefix(b"event: ").decode() for frame in frames] == [
        event["type"] for event in parsed
    ]
    delta = parsed[5]
    assert (delta["delta"], delta["response_id"], delta["item_id"]) == (",", "resp-1", "msg-resp-1")
    assert parsed[6]["text"] == "Hello,"
    assert parsed[-1]["response"]["usage"] == {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}


def test_completions_chunks() -> None:
    stream = fmt.CompletionsStream("c-1", "m", "fp", 1, include_usage=False)
    chunk = orjson.loads(events(stream.token(0))[0].removeprefix(b"data: "))
    assert chunk["object"] == "text_completion" and chunk["choices"][0]["text"] == "Hello"


def test_usage_totals_stay_within_u64_for_the_largest_claimed_prompt() -> None:
    """x-input-tokens may claim u64::MAX: the total saturates instead of failing to encode."""
    top = U64_MAX
    responses = fmt.ResponsesStream("id-1", "m", 1).finish(top, 3)
    completed = orjson.loads(events(responses)[-1].split(b"data: ", 1)[1])
    assert completed["response"]["usage"]["total_tokens"] == top
    chat = fmt.ChatStream("id-1", "m", "fp", 1, include_usage=True).finish(top, 3)
    assert orjson.loads(events(chat)[1].removeprefix(b"data: "))["usage"]["total_tokens"] == top
    for body in (
        fmt.chat_body("id-1", "m", "fp", 1, top, 3),
        fmt.completions_body("id-1", "m", "fp", 1, top, 3),
        fmt.response_body("id-1", "m", 1, top, 3),
    ):
        assert orjson.loads(orjson.dumps(body))["usage"]["total_tokens"] == top
