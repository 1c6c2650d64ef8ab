"""The request-body replay buffer (spec §4.5).

The body is received before the request is routed (``read_ahead``) as far as it is kept: a request
whose body trickles in holds no backend's slot meanwhile. The first attempt sends what was read and
streams the rest (a body past the cap) while keeping it too, in a buffer capped at
``--proxy-max-replay-body-bytes``; later attempts resend the buffered bytes. The body stays opaque:
chunks are forwarded as they arrived, never parsed or re-split. Buffered bytes count against the
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
        self._buffer: list[bytes] | None = []  # the chunks as received, shared with the first send
        self._size = 0  # bytes in ``_buffer``, held in ``budget``
        self._over: bytes | None = None  # read ahead, and past what the buffer can keep
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
        replay._size = len(body)
        return replay

    @property
    def buffered(self) -> int:
        return self._size

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
        self._frozen = b"".join(self._buffer)
        self._buffer = None  # the frozen copy replaces it, under the same room in the budget
        return self._frozen

    async def read_ahead(self) -> None:
        """Receive the body before any attempt, as far as the buffer keeps it (the limit, the
        budget); the first attempt streams the rest. A body that keeps coming, however slowly, is
        no backend's load until it is in: routed at once, it counted as a request in flight
        there, and a few clients trickling their bodies filled every slot of an idle fleet."""
        source = self._source
        if source is None or self._started:
            return
        rest = aiter(source)
        self._source = rest
        while True:
            chunk = await anext(rest, None)
            if chunk is None:
                self._complete = True
                return
            if not self._fits(chunk):
                self._over = chunk
                return
            self._take(chunk)

    def release(self) -> None:
        """No attempt will need the body again: give its memory back (idempotent)."""
        self._buffer = None
        self._frozen = None
        self._over = None
        self._unkept = True
        self._drop()

    async def _stream(self, source: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        # Marked started only once iterated: a connect failure before sending leaves the body replayable.
        self._started = True
        for chunk in list(self._buffer or ()):  # read ahead
            yield chunk
        over, self._over = self._over, None
        if over is not None:
            self._keep(over)
            yield over
        if self._complete:
            return
        async for chunk in source:
            self._keep(chunk)
            yield chunk
        self._complete = True

    def _fits(self, chunk: bytes) -> bool:
        return self._size + len(chunk) <= self._limit and self._budget.try_take(len(chunk))

    def _take(self, chunk: bytes) -> None:
        """Keep ``chunk``, whose room ``_fits`` took."""
        assert self._buffer is not None
        self._buffer.append(chunk)
        self._size += len(chunk)

    def _keep(self, chunk: bytes) -> None:
        """Keep ``chunk`` while the buffer fits the limit and the budget, else drop the buffer."""
        if self._buffer is None:
            return
        if self._fits(chunk):
            self._take(chunk)
            return
        self._unkept = self._size + len(chunk) <= self._limit  # no room in the budget
        self._buffer = None
        self._drop()

    def _drop(self) -> None:
        if self._size:
            self._budget.give(self._size)
            self._size = 0
