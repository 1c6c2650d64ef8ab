"""Server-sent events as router and Pylon read them: where an event ends, and which events carry
generated output. Both mark a request's prefill over at its first output event; a Responses API
stream sends typed events (``response.created``, ``response.in_progress``) before that, at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson

MAX_PENDING_EVENT = 1024 * 1024
"""An unterminated event longer than this is no event stream a reader can follow."""

_DELIMS = (b"\r\n\r\n", b"\n\n", b"\r\r")
"""Blank lines end an event; a line ends in CRLF, LF or CR (the SSE grammar)."""


class EventTooLarge(Exception):
    """An unterminated SSE event exceeded ``MAX_PENDING_EVENT``."""


def split_complete(buf: bytes) -> tuple[bytes, bytes]:
    """``buf`` as (its complete events, the unterminated rest); raises ``EventTooLarge`` when the
    rest outgrows ``MAX_PENDING_EVENT``."""
    cut = max((end + len(delim) for delim in _DELIMS if (end := buf.rfind(delim)) >= 0), default=0)
    if len(buf) - cut > MAX_PENDING_EVENT:
        raise EventTooLarge
    return buf[:cut], buf[cut:]


def iter_events(blob: bytes) -> Iterator[bytes]:
    """Raw events of ``blob``, each with its delimiter; a plain ``split`` when no CR is present."""
    if b"\r" not in blob:
        parts = blob.split(b"\n\n")
        last = parts.pop()
        for part in parts:
            yield part + b"\n\n"
        if last:
            yield last
        return
    start = 0
    while start < len(blob):
        ends = [(i, len(d)) for d in _DELIMS if (i := blob.find(d, start)) >= 0]
        if not ends:
            yield blob[start:]
            return
        i, n = min(ends)
        yield blob[start : i + n]
        start = i + n


def event_data(raw: bytes) -> tuple[bytes | None, bytes]:
    """(event name, data lines joined with ``\\n``) of one raw SSE event."""
    name: bytes | None = None
    data: list[bytes] = []
    for line in raw.splitlines():
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip())
        elif line.startswith(b"event:") and name is None:
            name = line[6:].strip()
    return name, b"\n".join(data)


def is_output(raw: bytes) -> bool:
    """Whether an SSE event carries generated output. Of the Responses API's typed events (by
    ``event:`` name, else the data's ``type``) only the ``*.delta`` ones do (not in the original,
    where every event but ``response.created`` counts): an engine sends ``response.in_progress``,
    ``response.output_item.added`` and ``response.content_part.added`` before its first token, and
    counted as output they put the first token, and the input rate measured from it, at the start."""
    kind = _response_kind(raw)
    if kind is None:
        return False
    if kind.startswith(b"response."):
        return kind.endswith(b".delta")
    return True


def is_answer(raw: bytes) -> bool:
    """Whether an SSE event is part of an answer: the original's output rule, every event with
    data but ``[DONE]`` and ``response.created``. A stream that ends without one was no answer
    (pylon.md behaviour 96); a Responses stream of ``response.created`` and ``response.failed``
    was one, without output."""
    kind = _response_kind(raw)
    return kind is not None and kind != b"response.created"


def _response_kind(raw: bytes) -> bytes | None:
    """A Responses API event's type (``event:`` name, else the data's ``type``); ``b""`` for any
    other event with data; None for an event without data or ``[DONE]``."""
    name, data = event_data(raw)
    if not data or data == b"[DONE]":
        return None
    if name is not None:
        return name
    if b'"response.' in data:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""
        typed = obj.get("type") if isinstance(obj, dict) else None
        if isinstance(typed, str):
            return typed.encode()
    return b""


class FirstOutput:
    """Watches a stream's chunks for the end of its first output event."""

    __slots__ = ("_tail", "seen")

    def __init__(self) -> None:
        self._tail = b""
        self.seen = False

    def feed(self, chunk: bytes) -> bool:
        """True once the first output event has completed, in this chunk or an earlier one; an
        event too large to follow counts as output (the watch ends, its memory with it)."""
        if self.seen:
            return True
        try:
            complete, self._tail = split_complete(self._tail + chunk if self._tail else chunk)
        except EventTooLarge:
            complete, self._tail = b"", b""
            self.seen = True
        else:
            self.seen = any(is_output(raw) for raw in iter_events(complete))
        if self.seen:
            self._tail = b""
        return self.seen


_DONE_LINES = (b"data: [DONE]", b"data:[DONE]")
_DONE_TAIL = 24
"""Bytes kept of what a client was sent: a ``data: [DONE]`` event with its delimiters fits."""
_LAST_EVENTS = frozenset((b"response.completed", b"response.failed", b"response.incomplete"))
"""The events that end a Responses stream (it has no ``[DONE]``)."""


class Delivered:
    """The end of the bytes a client has been sent, to tell whether they end with the event that
    ends an answer, whole: ``data: [DONE]``, or a Responses stream's ``response.completed`` (or
    ``.failed``, ``.incomplete``). The answer is complete there: the openai SDK closes its
    connection as it reads that event, before the chunked body's end, which an engine may write a
    moment later (uvicorn's do), and that hang-up abandons nothing."""

    __slots__ = ("_event", "_start", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._start = True  # the tail still holds the stream's first byte
        self._event = b""  # the name of the last ``event:`` line sent

    def sent(self, chunk: bytes) -> None:
        self._start = self._start and len(self._tail) + len(chunk) <= _DONE_TAIL
        tail = self._tail + chunk if len(chunk) < _DONE_TAIL else chunk
        self._tail = tail[-_DONE_TAIL:]
        # A data line cannot hold a line break (JSON escapes it), so a line starting "event:" is one.
        line = chunk.rfind(b"\nevent:") + 1
        if line or chunk.startswith(b"event:"):
            end = chunk.find(b"\n", line)
            self._event = chunk[line + 6 : end if end >= 0 else len(chunk)].strip()

    @property
    def done(self) -> bool:
        """The client has the stream's last event, whole, as the last it was sent."""
        tail = self._tail
        for delim in _DELIMS:
            if tail.endswith(delim):
                if self._event in _LAST_EVENTS:
                    return True
                event = tail[: -len(delim)]
                start = max(event.rfind(b"\n"), event.rfind(b"\r")) + 1
                return (start > 0 or self._start) and event[start:] in _DONE_LINES
        return False
