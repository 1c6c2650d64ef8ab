from __future__ import annotations

from stargate.mock_engine.control import TestControl
from stargate.mock_engine.stats_stream import StatsHub, ping_line, stats_line


def test_s9_36_stats_line_exact_bytes() -> None:
    assert stats_line("req-1", "dummy-model", 11, 2, True) == (
        b'{"type":"stats","v":1,"request_id":"req-1","model":"dummy-model",'
        b'"tokens_processed":11,"tokens_generated":2,"finished":true}\n'
    )


def test_stats_line_omits_absent_fields() -> None:
    assert stats_line("r", "m", 5, None, False) == (
        b'{"type":"stats","v":1,"request_id":"r","model":"m","tokens_processed":5}\n'
    )


def test_ping_advertises_known_concurrency_limit() -> None:
    assert ping_line("m", 0) == b'{"type":"ping","v":1}\n'
    assert ping_line("llama", 25) == b'{"type":"ping","v":1,"model":"llama","max_engine_concurrency":25}\n'


def test_emit_without_subscribers_is_discarded() -> None:
    hub = StatsHub("m", 0)
    hub.emit("r", "m", 1, 0)
    assert not hub.active and hub.subscriber_count == 0


def test_test_control_override_replaces_the_advertised_limit() -> None:
    control = TestControl("m")
    hub = StatsHub("m", 8, control.limit_overrides)
    assert b'"max_engine_concurrency":8' in hub.current_ping()
    control.set_model("m", {"max_engine_concurrency": 0})
    assert hub.current_ping() == b'{"type":"ping","v":1,"model":"m","max_engine_concurrency":0}\n'
    control.set_model("m", {"max_engine_concurrency": None})
    assert b'"max_engine_concurrency":8' in hub.current_ping()
