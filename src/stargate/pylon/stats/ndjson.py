"""Engine stats stream protocol, consumer side (spec pylon.md §6.2): line framing and validation.

Pure functions: ``LineSplitter`` turns body chunks into lines (≤ 64 KiB each, longer ones are
reported as ``line_too_large`` and skipped up to the next newline) and ``parse_line`` turns one
line into a ``StatsEvent``, ``PingEvent`` or ``Invalid(reason)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

MAX_LINE = 64 * 1024


@dataclass(frozen=True, slots=True)
class StatsEvent:
    request_id: str
    model: str
    tokens_processed: int | None
    tokens_generated: int | None
    finished: bool


@dataclass(frozen=True, slots=True)
class PingEvent:
    model: str | None = None
    max_engine_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str


Event = StatsEvent | PingEvent | Invalid
TOO_LARGE = Invalid("line_too_large")


def _uint(value: object) -> bool:
    return type(value) is int and value >= 0


def _required_str(obj: dict[str, object], key: str) -> str | Invalid:
    if key not in obj:
        return Invalid("missing_field")
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        return Invalid("field")
    return value.strip()


def parse_line(line: bytes) -> Event | None:
    """None for a blank line (ignored without counting)."""
    if not line.strip():
        return None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return Invalid("json")
    if not isinstance(obj, dict):
        return Invalid("not_object")
    if "v" not in obj or "type" not in obj:
        return Invalid("missing_field")
    if not _uint(obj["v"]) or obj["v"] != 1:
        return Invalid("version")
    kind = obj["type"]
    if not isinstance(kind, str):
        return Invalid("field")
    if kind == "ping":
        return _parse_ping(obj)
    if kind != "stats":
        return Invalid("type")
    request_id = _required_str(obj, "request_id")
    if isinstance(request_id, Invalid):
        return request_id
    model = _required_str(obj, "model")
    if isinstance(model, Invalid):
        return model
    counters: list[int | None] = []
    for key in ("tokens_processed", "tokens_generated"):
        value = obj.get(key)
        if value is not None and not _uint(value):
            return Invalid("field")
        if key in obj and value is None:
            return Invalid("field")
        counters.append(value if isinstance(value, int) else None)
    finished = obj.get("finished", False)
    if not isinstance(finished, bool):
        return Invalid("field")
    if counters == [None, None] and not finished:
        return Invalid("empty_stats")
    return StatsEvent(request_id, model, counters[0], counters[1], finished)


def _parse_ping(obj: dict[str, object]) -> Event:
    model: str | None = None
    if "model" in obj:
        raw = obj["model"]
        if not isinstance(raw, str) or not raw.strip():
            return Invalid("field")
        model = raw.strip()
    limit = obj.get("max_engine_concurrency")
    if "max_engine_concurrency" in obj:
        if not _uint(limit):
            return Invalid("field")
        if model is None:
            return Invalid("missing_field")
    return PingEvent(model, limit if isinstance(limit, int) else None)


class LineSplitter:
    """Incremental ``\\n`` framing with a trailing ``\\r`` removed and a 64 KiB line cap."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._max = max_line
        self._buf = bytearray()
        self._discarding = False

    def feed(self, chunk: bytes) -> list[bytes | Invalid]:
        out: list[bytes | Invalid] = []
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            piece = chunk[start:nl]
            start = nl + 1
            if self._discarding:
                self._discarding = False
                self._buf.clear()
                continue
            self._buf += piece
            line = bytes(self._buf)
            self._buf.clear()
            if line.endswith(b"\r"):
                line = line[:-1]
            out.append(TOO_LARGE if len(line) > self._max else line)
        if not self._discarding:
            self._buf += chunk[start:]
            if len(self._buf) > self._max + 1:
                self._buf.clear()
                self._discarding = True
                out.append(TOO_LARGE)
        return out
