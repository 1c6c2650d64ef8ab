"""The request-body replay buffer (spec §4.5).

The first attempt streams the client body to the backend while copying it into a buffer capped at
``--proxy-max-replay-body-bytes``; later attempts resend the buffered bytes. The body stays opaque:
chunks are forwarded as they arrive, never parsed or re-split. Buffered bytes count against the
router's ``BodyBudget``; a body that finds no room there is not kept (it is sent once, like one
whose stream broke) rather than held at the cost of the router's memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from enum import Enum

from stargate.wire.body_budget import UNCAPPED, BodyBudget


class Readiness(Enum):
    READY = "ready"  # never consumed, or fully read within the limit
    INCOMPLETE = "incomplete"  # still streaming, errored or abandoned, or not kept for lack of room
    PAYLOAD_TOO_LARGE = "payload_too_large"  # the limit was exceeded and the buffer dropped


class ReplayBody:
    """One request's body: a live stream for the first consuming attempt, bytes afterwards."""

    def __init__(
        self, source: AsyncIterable[bytes] | None, limit: int, budget: BodyBudget = UNCAPPED
    ) -> None:
        self._source = source
        self._limit = limit
        self._budget = budget
        self._buffer: bytearray | None = bytearray()
        self._held = 0  # bytes of ``budget`` this body holds
        self._unkept = False  # dropped for lack of room in the budget, not for the limit
        self._started = source is None
        self._complete = source is None
        self._frozen: bytes | None = None

    @classmethod
    def read(cls, body: bytes, budget: BodyBudget = UNCAPPED) -> ReplayBody:
        """A body already read whole (plain-client mode), resent as is; its ``len(body)`` bytes of
        ``budget``, taken by the reader, are given back by ``release``."""
        replay = cls(None, len(body), budget)
        replay._frozen = body
        replay._held = len(body)
        return replay

    @property
    def buffered(self) -> int:
        if self._frozen is not None:
            return len(self._frozen)
        return len(self._buffer) if self._buffer is not None else 0

    def readiness(self) -> Readiness:
        if self._frozen is not None:
            return Readiness.READY
        if self._buffer is None:
            return Readiness.INCOMPLETE if self._unkept else Readiness.PAYLOAD_TOO_LARGE
        if not self._started or self._complete:
            return Readiness.READY
        return Readiness.INCOMPLETE

    def body(self) -> bytes | AsyncIterable[bytes]:
        """What the next attempt sends; only valid while ``readiness()`` is READY."""
        if self._frozen is not None:
            return self._frozen
        if not self._started:
            return self._stream(self._source) if self._source is not None else b""
        if self._buffer is None or not self._complete:
            raise RuntimeError("request body is not replayable")
        self._frozen = bytes(self._buffer)
        self._buffer = None  # the frozen copy replaces it, under the same room in the budget
        return self._frozen

    def release(self) -> None:
        """No attempt will need the body again: give its memory back (idempotent)."""
        self._buffer = None
        self._frozen = None
        self._unkept = True
        if self._held:
            self._budget.give(self._held)
            self._held = 0

    async def _stream(self, source: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        # Marked started only once iterated: a connect failure before sending leaves the body replayable.
        self._started = True
        async for chunk in source:
            buffer = self._buffer
            if buffer is not None:
                if len(buffer) + len(chunk) > self._limit:
                    self._drop()
                elif self._budget.try_take(len(chunk)):
                    self._held += len(chunk)
                    buffer.extend(chunk)
                else:
                    self._drop()
                    self._unkept = True
            yield chunk
        self._complete = True

    def _drop(self) -> None:
        self._buffer = None
        if self._held:
            self._budget.give(self._held)
            self._held = 0
