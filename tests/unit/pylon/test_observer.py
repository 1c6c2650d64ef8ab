from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stargate.pylon.models import Generation
from stargate.pylon.observer import RequestObserver, SseScanner, json_usage
from stargate.pylon.stats.observation import Endpoint, Observation, State, embedding_item_count
from stargate.wire.clock import ManualClock
from stargate.wire.sse import MAX_PENDING_EVENT, EventTooLarge


def test_b97_oversize_unterminated_event_aborts() -> None:
    with pytest.raises(EventTooLarge):
        SseScanner().feed(b"data: " + b"x" * (MAX_PENDING_EVENT + 1))


def test_b98_response_created_is_not_output() -> None:
    s = SseScanner()
    assert not s.feed(b'event: response.created\ndata: {"type":"response.created"}\n\n')
    assert s.feed(b'event: response.output_text.delta\ndata: {"type":"x","delta":"hi"}\n\n')


def test_only_the_deltas_of_a_responses_stream_are_output() -> None:
    # As vLLM and OpenAI send it: four structural events before the first token.
    s = SseScanner()
    for kind in ("response.created", "response.in_progress", "response.output_item.added"):
        assert not s.feed(b'event: %s\ndata: {"type":"%s"}\n\n' % (kind.encode(), kind.encode()))
    assert not s.feed(b'data: {"type":"response.content_part.added","part":{"text":""}}\n\n')  # no name
    assert s.feed(b'data: {"type":"response.output_text.delta","delta":"2"}\n\n')
    assert s.tokens == 1
    s = SseScanner()  # a tool call's first token is its arguments' first delta
    assert not s.feed(b'event: response.output_item.added\ndata: {"type":"response.output_item.added"}\n\n')
    assert s.feed(b'event: response.function_call_arguments.delta\ndata: {"delta":"{"}\n\n')


def test_b99_crlf_comment_and_split_chunks() -> None:
    s = SseScanner()
    assert not s.feed(b': keepalive\r\n\r\ndata: {"choices":')
    assert s.feed(b'[{"delta":{"content":"a"}}]}\r\n\r\n')
    assert s.tokens == 1


_STREAM = (
    b": keepalive\r\n\r\n"
    b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    b'data: {"choices":[{"delta":{"content":"b"}}]}\r\n\r\n'
    b'data: {"choices":[{"delta":{"content":"c"}}]}\n\n'
    b"data: [DONE]\n\n"
)


@given(st.sets(st.integers(1, len(_STREAM) - 1)))
def test_an_event_split_across_reads_scans_as_whole(cuts: set[int]) -> None:
    """TCP delivers an event in as many reads as it likes (a slow link, a large event)."""
    bounds = [0, *sorted(cuts), len(_STREAM)]
    s = SseScanner()
    firsts = [s.feed(_STREAM[a:b]) for a, b in itertools.pairwise(bounds)]
    assert firsts.count(True) == 1
    assert s.output_seen and s.tokens == 3


def test_an_event_sent_byte_by_byte_is_output() -> None:
    s = SseScanner()
    event = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert [s.feed(event[i : i + 1]) for i in range(len(event))][-1]
    assert s.tokens == 1


def test_b100_explicit_counters_cumulative() -> None:
    s = SseScanner()
    seen = []
    for n in (1, 2, 2):
        s.feed(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % n)
        seen.append(s.tokens)
    assert seen == [1, 2, 2]


def test_b101_estimate_then_explicit() -> None:
    s = SseScanner()
    s.feed('data: {"choices":[{"delta":{"content":"。"}}]}\n\n'.encode())
    assert s.tokens == 1
    s.feed(b'data: {"choices":[],"usage":{"completion_tokens":7}}\n\ndata: [DONE]\n\n')
    assert s.tokens == 7


def test_b102_output_tokens_so_far() -> None:
    s = SseScanner()
    s.feed(b'data: {"output_tokens_so_far":4}\n\n')
    assert s.explicit_tokens == 4


def test_b103_responses_usage() -> None:
    s = SseScanner()
    s.feed(b'data: {"type":"response.output_text.delta","delta":"hello world"}\n\n')
    s.feed(b'data: {"type":"response.completed","response":{"usage":{"output_tokens":3}}}\n\n')
    assert s.tokens == 3


def test_done_and_empty_data_are_not_output() -> None:
    s = SseScanner()
    assert not s.feed(b"data: [DONE]\n\ndata:\n\n")
    assert not s.output_seen


def make_observer(
    endpoint: Endpoint = Endpoint.CHAT,
) -> tuple[RequestObserver, list[Observation], ManualClock]:
    seen: list[Observation] = []
    clock = ManualClock()
    o = RequestObserver(
        request_id="r",
        generation=Generation("m", 1),
        endpoint=endpoint,
        input_tokens=5,
        clock=clock,
        sink=seen.append,
    )
    return o, seen, clock


def test_b104_lifecycle_observations() -> None:
    o, seen, clock = make_observer()
    assert seen[0].state is State.UPSTREAM_CONNECTING and seen[0].upstream_status is None
    clock.advance(0.1)
    o.headers(200)
    clock.advance(0.2)
    o.output(1)
    assert [x.state for x in seen] == [
        State.UPSTREAM_CONNECTING,
        State.INPUT_PROCESSING,
        State.OUTPUT_GENERATION,
    ]
    assert seen[-1].time_to_first_output == pytest.approx(0.3)
    assert o.finish() is State.COMPLETE


def test_b105_cancelled_and_failed() -> None:
    o, seen, _ = make_observer()
    o.cancel()
    assert seen[-1].state is State.CANCELLED
    o2, seen2, _ = make_observer()
    o2.finish(failed=True)
    assert seen2[-1].state is State.FAILED


def test_b106_embeddings_terminal_states() -> None:
    o, _, _ = make_observer(Endpoint.EMBEDDINGS)
    o.headers(200)
    assert o.finish() is State.COMPLETE
    o2, _, _ = make_observer(Endpoint.EMBEDDINGS)
    o2.headers(500)
    assert o2.finish() is State.FAILED


@pytest.mark.parametrize(
    ("body", "items"),
    [
        ({"input": "hello"}, 1),
        ({"input": ["a", "b"]}, 2),
        ({"input": [1, 2, 3]}, 1),
        ({"input": [[1, 2], [3, 4], [5]]}, 3),
        ({"input": []}, 0),
        ({"input": [True, False]}, 2),  # booleans are not token ids
        ({"input": 7}, None),
        ({}, None),
        (["hello"], None),
    ],
)
def test_b107_embedding_item_counts(body: object, items: int | None) -> None:
    assert embedding_item_count(body) == items


def test_completions_chunks_count_their_text_pieces() -> None:
    s = SseScanner(completions=True)
    s.feed(b'data: {"choices":[{"text":"Hel"}]}\n\ndata: {"choices":[{"text":""}]}\n\n')
    s.feed(b'data: {"choices":[{"text": "lo"}]}\n\ndata: [DONE]\n\n')
    assert s.output_seen and s.tokens == 2


def test_json_answers_report_their_output_tokens() -> None:
    assert json_usage(b'{"usage":{"prompt_tokens":3,"completion_tokens":7}}') == (7, 3, None)
    assert json_usage(b'{"object":"response","usage":{"input_tokens":4,"output_tokens":5}}') == (5, 4, None)
    assert json_usage(b'{"choices":[]}') == (None, None, None)
    assert json_usage(b"not json") == (None, None, None)


def test_usage_reports_the_prompt_tokens_the_engine_had_cached() -> None:
    chat = (
        b'{"usage":{"prompt_tokens":300,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":256}}}'
    )
    assert json_usage(chat) == (7, 300, 256)
    responses = b'{"usage":{"input_tokens":40,"output_tokens":5,"input_tokens_details":{"cached_tokens":32}}}'
    assert json_usage(responses) == (5, 40, 32)
    assert json_usage(b'{"usage":{"prompt_tokens":3,"prompt_tokens_details":null}}') == (None, 3, None)
    # A cached count without the prompt's is nothing to subtract from.
    no_prompt = b'{"usage":{"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":2}}}'
    assert json_usage(no_prompt) == (1, None, None)
    scanner = SseScanner()
    scanner.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    scanner.feed(
        b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1,'
        b'"prompt_tokens_details":{"cached_tokens":8}}}\n\n'
    )
    assert (scanner.prompt_tokens, scanner.cached_tokens, scanner.tokens) == (12, 8, 1)
