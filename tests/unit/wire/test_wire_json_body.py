"""``wire.json_body.loads``: orjson's result, with no garbage collection during the parse."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from stargate.wire import json_body

MANY_ARRAYS = b"[" + b"[]," * 100_000 + b"[]]"


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """Generations of the collections that start while the test runs."""
    started: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    try:
        yield started
    finally:
        gc.callbacks.remove(count)


def test_a_body_of_many_containers_is_parsed_without_a_collection(collections: list[int]) -> None:
    assert gc.isenabled()
    parsed = json_body.loads(MANY_ARRAYS)
    during = len(collections)
    assert parsed == orjson.loads(MANY_ARRAYS)  # what the pause avoids: 100 001 tracked lists
    assert during == 0 < len(collections)  # trigger collections as they are made
    assert gc.isenabled()


def test_the_collector_is_restored_after_a_parse_error() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        json_body.loads(b"[[]")
    assert gc.isenabled()
    gc.disable()
    try:
        assert json_body.loads(b"[]") == []
        assert not gc.isenabled()  # a collector paused by someone else stays paused
    finally:
        gc.enable()
