from __future__ import annotations

import pytest

from stargate.pylon.stats.ndjson import (
    MAX_LINE,
    TOO_LARGE,
    Invalid,
    LineSplitter,
    PingEvent,
    StatsEvent,
    parse_line,
)


def test_b41_full_stats_line() -> None:
    line = (
        b'{"v":1,"type":"stats","request_id":"req-1","model":"llama","tokens_processed":4096,'
        b'"tokens_generated":128,"finished":true}'
    )
    assert parse_line(line) == StatsEvent("req-1", "llama", 4096, 128, True)


@pytest.mark.parametrize(
    "line",
    [
        b'{"v":2,"type":"ping"}',
        b'{"v":1,"type":"other"}',
        b'{"v":1,"type":"stats","request_id":"r","model":"m"}',
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_processed":-1}',
        b'{"v":1,"type":"stats","request_id":"r","model":"m","tokens_generated":1.5}',
        b'{"v":"1","type":"ping"}',
        b'{"v":1,"type":"stats","request_id":"r","model":"m","finished":"true"}',
        b'{"v":1,"type":"stats","request_id":null,"model":"m","finished":true}',
        b"[1,2]",
        b'{"v":1,"type":"ping"} garbage',
    ],
)
def test_b42_invalid_lines(line: bytes) -> None:
    assert isinstance(parse_line(line), Invalid)


def test_b43_line_size_limit() -> None:
    splitter = LineSplitter()
    exact = b'{"v":1,"type":"ping"}'.ljust(MAX_LINE, b" ")
    out = splitter.feed(exact + b"\n" + b"x" * (MAX_LINE + 1) + b"\n" + b'{"v":1,"type":"ping"}\n')
    assert out[0] == exact and parse_line(out[0]) == PingEvent()
    assert out[1] is TOO_LARGE
    assert parse_line(out[2]) == PingEvent()  # type: ignore[arg-type]


def test_b43_unterminated_oversize_tail_dropped_then_recovers() -> None:
    splitter = LineSplitter()
    assert splitter.feed(b"y" * (MAX_LINE + 10)) == [TOO_LARGE]
    assert splitter.feed(b"yyy\n" + b'{"v":1,"type":"ping"}\n') == [b'{"v":1,"type":"ping"}']


def test_b44_blank_lines_ignored() -> None:
    lines = LineSplitter().feed(b"\n\r\n" + b'{"v":1,"type":"ping"}\r\n')
    assert [parse_line(x) for x in lines if not isinstance(x, Invalid)] == [None, None, PingEvent()]


def test_b81_ping_limit_requires_model() -> None:
    assert parse_line(b'{"v":1,"type":"ping","max_engine_concurrency":4}') == Invalid("missing_field")
    assert parse_line(b'{"v":1,"type":"ping","model":"llama","max_engine_concurrency":40}') == PingEvent(
        "llama", 40
    )
