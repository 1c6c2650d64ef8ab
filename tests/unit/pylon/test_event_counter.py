"""EventCounter exposes exactly what a prometheus_client Counter with the same increments does."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as client_metrics

from stargate.pylon.event_counter import EventCounter


def _exposition() -> tuple[bytes, bytes]:
    counter_registry, event_registry = CollectorRegistry(), CollectorRegistry()
    counter = Counter("pylon_x", "Doc", ["source", "reason"], registry=counter_registry)
    events = EventCounter("pylon_x", "Doc", ["source", "reason"])
    event_registry.register(events)
    assert generate_latest(counter_registry) == generate_latest(event_registry)  # described, no series
    for values in [("a", "b"), ("a", "b"), ("a", 'q"\n'), ("c", "b")]:
        counter.labels(*values).inc()
        events.inc(*values)
    return generate_latest(counter_registry), generate_latest(event_registry)


def _timestamps_masked(text: bytes) -> bytes:
    return re.sub(rb"(_created\{[^}]*\}) \S+", rb"\1 T", text)


def test_same_exposition_as_a_counter() -> None:
    counter, events = _exposition()
    assert b"_created" in events
    assert _timestamps_masked(counter) == _timestamps_masked(events)


def test_created_series_follow_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_metrics, "_use_created", False)
    counter, events = _exposition()
    assert b"_created" not in events
    assert counter == events


def test_names_are_reserved() -> None:
    registry = CollectorRegistry()
    registry.register(EventCounter("pylon_x", "Doc", ["type"]))
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("pylon_x", "Doc", registry=registry)
