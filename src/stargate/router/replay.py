"""The request-body replay buffer (spec §4.5).

The first attempt streams the client body to the backend while copying it into a buffer capped at
``--proxy-max-replay-body-bytes``; later attempts resend the buffered bytes. The body stays opaque:
chunks are forwarded as they arrive, never parsed or re-split. A body with a declared length (already
checked against the limit) is read whole first and sent as one ``bytes`` payload: the buffer holds it
anyway, and one payload saves the per-chunk streaming work on both ends.
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

    def __init__(self, source: AsyncIterable[bytes] | None, limit: int, *, length: int | None = None) -> None:
        self._source = source
        self._limit = limit
        self._length = length
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

    async def next_body(self) -> bytes | AsyncIterable[bytes]:
        """Like ``body()``, but a declared-length body is first read whole into the buffer.

        A read that fails part-way (or a body that outgrows the limit) continues as a stream of what
        arrived, so the attempt ends exactly as a streamed body would.
        """
        source, buffer = self._source, self._buffer
        if self._started or source is None or self._length is None or buffer is None:
            return self.body()
        self._started = True
        chunks = aiter(source)
        try:
            async for chunk in chunks:
                if len(buffer) + len(chunk) > self._limit:
                    self._buffer = None
                    return self._resume(bytes(buffer) + chunk, chunks, None)
                buffer.extend(chunk)
        except Exception as exc:
            return self._resume(bytes(buffer), None, exc)
        self._complete = True
        self._frozen = bytes(buffer)
        return self._frozen

    async def _resume(
        self, head: bytes, rest: AsyncIterator[bytes] | None, error: Exception | None
    ) -> AsyncIterator[bytes]:
        if head:
            yield head
        if error is not None:
            raise error
        if rest is not None:
            async for chunk in rest:
                yield chunk
        self._complete = True

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
