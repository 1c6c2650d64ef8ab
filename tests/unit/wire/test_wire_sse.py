"""Server-sent events as router and Pylon read them: event ends and which events are output."""

from __future__ import annotations

import pytest

from stargate.wire.sse import Delivered, FirstOutput, is_answer, is_output, split_complete


@pytest.mark.parametrize(
    ("event", "output", "answer"),
    [
        (b'event: response.created\ndata: {"type":"response.created"}\n\n', False, False),
        (b'data: {"type":"response.in_progress"}\n\n', False, True),
        (b'event: response.failed\ndata: {"type":"response.failed"}\n\n', False, True),
        (b'data: {"type":"response.output_text.delta","delta":"x"}\n\n', True, True),
        (b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n', True, True),
        (b"data: [DONE]\n\n", False, False),
        (b": keepalive\n\n", False, False),
    ],
)
def test_output_is_a_token_and_an_answer_any_event_but_response_created(
    event: bytes, output: bool, answer: bool
) -> None:
    assert (is_output(event), is_answer(event)) == (output, answer)


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_an_event_ends_at_a_blank_line_of_any_line_ending(end: bytes) -> None:
    event = b"data: {}" + end
    assert split_complete(event + b"data: par") == (event, b"data: par")
    watch = FirstOutput()
    assert not watch.feed(b'event: response.created\ndata: {"type":"response.created"}' + end)
    assert not watch.feed(b'data: {"type":"response.output_text.delta"')
    assert watch.feed(b"}" + end) and watch.feed(b"anything")


@pytest.mark.parametrize(
    ("pieces", "done"),
    [
        ([b'data: {"n":1}\n\ndata: [DONE]\n\n'], True),
        ([b'data: {"n":1}\n\n' * 10, b"data: [DO", b"NE]\n", b"\n"], True),  # split anywhere
        ([b"data:[DONE]\r\n\r\n"], True),
        ([b"x" * 100 + b"\rdata: [DONE]\r\r"], True),
        ([b"data: [DONE]\n"], False),  # the event is not whole yet
        ([b"data: [DONE]\n\n", b'data: {"n":2}\n\n'], False),  # not the last thing sent
        ([b'data: {"text":"data: [DONE]"}\n\n'], False),
        ([b'data: {"text":"' + b"x" * 30 + b"data: [DONE]\n\n"], False),  # a line whose start is gone
        ([b"data: [DONE]\n\n"], True),  # the whole stream
        ([b"data: [DONE] \n\n"], False),
        ([], False),
        # A Responses stream ends with response.completed (or .failed, .incomplete), no [DONE].
        (
            [
                b'event: response.output_text.delta\ndata: {"delta":"x"}\n\n',
                b"event: response.completed\n",
                b'data: {"type":"response.completed","response":{"output":[]}}\n\n',
            ],
            True,
        ),
        ([b'event: response.failed\r\ndata: {"type":"response.failed"}\r\n\r\n'], True),
        ([b'event: response.completed\ndata: {"type":"response.completed","resp'], False),  # not whole
        ([b'event: response.output_text.delta\ndata: {"delta":"event: response.completed"}\n\n'], False),
        ([b"event: response.completed\ndata: {}\n\n", b"event: response.created\ndata: {}\n\n"], False),
    ],
)
def test_delivered_tells_a_stream_whose_last_event_is_done(pieces: list[bytes], done: bool) -> None:
    delivered = Delivered()
    for piece in pieces:
        delivered.sent(piece)
    assert delivered.done is done
