"""The request-body replay buffer (spec §4.5).

The first attempt streams the client body to the backend while copying it into a buffer capped at
``--proxy-max-replay-body-bytes``; later attempts resend the buffered bytes. The body stays opaque:
chunks are forwarded as they arrive, never parsed or re-split.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from enum import Enum


class Readiness(Enum):
    READY = "ready"  # never consumed, or fully read within the limit
    INCOMPLETE = "incomplete"  # still streaming, or the stream errored / was abandoned
    PAYLOAD_TOO_LARGE = "payload_too_large"  # the limit was exceeded and the buffer dropped


class ReplayBody:
    """One request's body: a live stream for the first consuming attempt, bytes afterwards."""

    def __init__(self, source: AsyncIterable[bytes] | None, limit: int) -> None:
        self._source = source
        self._limit = limit
        self._buffer: bytearray | None = bytearray()
        self._started = source is None
        self._complete = source is None
        self._frozen: bytes | None = None

    @property
    def buffered(self) -> int:
        return len(self._buffer) if self._buffer is not None else 0

    def readiness(self) -> Readiness:
        if self._buffer is None:
            return Readiness.PAYLOAD_TOO_LARGE
        if not self._started or self._complete:
            return Readiness.READY
        return Readiness.INCOMPLETE

    def body(self) -> bytes | AsyncIterable[bytes]:
        """What the next attempt sends; only valid while ``readiness()`` is READY."""
        if not self._started:
            return self._stream(self._source) if self._source is not None else b""
        if self._buffer is None or not self._complete:
            raise RuntimeError("request body is not replayable")
        if self._frozen is None:
            self._frozen = bytes(self._buffer)
        return self._frozen

    async def _stream(self, source: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        # Marked started only once iterated: a connect failure before sending leaves the body replayable.
        self._started = True
        async for chunk in source:
            buffer = self._buffer
            if buffer is not None:
                if len(buffer) + len(chunk) > self._limit:
                    self._buffer = None
                else:
                    buffer.extend(chunk)
            yield chunk
        self._complete = True
