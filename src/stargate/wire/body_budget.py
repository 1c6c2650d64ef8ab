"""A process-wide cap on the request-body bytes Stargate or Pylon holds in memory at once.

Each hop caps one body (Stargate's replay buffer, its plain-client read, Pylon's read), but not
their sum: 40 streamed requests of 50 MB took Stargate to 3 GB and each Pylon to 2 GB, so a single
client could exhaust the machine's memory and take every request in flight down with the process.
Bodies read whole wait (first come, first served) for room, so their memory is bounded and the
requests are delayed, not lost; a wait longer than ``wait_s`` (None: no limit) ends in
``BodyBufferFull``. A body only kept for replay takes room without waiting and is not kept when
there is none (the request goes on, without retries that need its body), as Envoy does past its
buffer limit.

A body read whole takes room for its declared length before its first byte, so bodies that arrive
at once never wait for each other's later bytes; one that then sends less than ``MIN_BODY_RATE``
in a ``stall_s`` gives back the room it has not filled and from then on takes room for its bytes
as they come, at once, up to twice the capacity (``take_arrived``). Forty connections that each
declared 64 MiB and sent a byte every 20 s held all of a Pylon's room, and every other request
waited for them; slow uploads now hold what they sent and still finish. A body of unknown length
(chunked) takes room only as its bytes come, the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from aiohttp import web

from stargate.errors import BodyBufferFull, PayloadTooLarge

STALL_S = 1.0
MIN_BODY_RATE = 1024 * 1024
"""A body read whole keeps the room it took ahead of its bytes while each ``STALL_S`` brings
``MIN_BODY_RATE * STALL_S`` bytes of it; after the first that does not, it takes room as they come."""


class BodyBudget:
    """Room for ``capacity`` bytes of request bodies (0 = no cap), shared by a process's requests.

    A caller takes its whole amount at once and gives it back when done: no request holds part of
    the room while it waits for the rest, so waiters cannot block each other for ever (bodies that
    slowed down take room piece by piece without waiting, ``take_arrived``, up to twice the cap).
    """

    def __init__(self, capacity: int, wait_s: float | None, *, stall_s: float = STALL_S) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.stall_s = stall_s
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def take_arrived(self, amount: int) -> bool:
        """Room for bytes that arrived for a body that gave back the room it had not filled: at
        once, without waiting, up to twice ``capacity``. A body waiting halfway could wait for
        others that wait halfway for it: slow uploads that filled the room stood still until their
        waits ran out."""
        if self.capacity and self.used + amount > 2 * self.capacity:
            return False
        self.used += amount
        return True

    def try_take(self, amount: int) -> bool:
        """Take ``amount`` if it fits now and nobody waits ahead."""
        if self.capacity and (self._waiters or self.used + amount > self.capacity):
            return False
        self.used += amount
        return True

    async def take(self, amount: int) -> None:
        """Take ``amount`` (at most ``capacity``), waiting behind earlier callers for room."""
        if self.try_take(amount):
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (amount, waiter)
        self._waiters.append(entry)
        try:
            async with asyncio.timeout(self.wait_s):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.give(amount)  # granted as the wait ended: not ours to keep
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):  # a give() meanwhile may have dropped it
                    self._waiters.remove(entry)
                self._grant()  # those behind may fit now
            if isinstance(exc, TimeoutError):  # only a set wait times out
                raise BodyBufferFull(
                    f"request bodies held in memory are at the limit of {self.capacity} bytes and "
                    f"none finished within {self.wait_s:g} s"
                ) from None
            raise

    async def read_whole(self, request: web.BaseRequest, cap: int) -> bytes:
        """The request's body, holding room for it (the module's rules); raises ``PayloadTooLarge``
        past ``cap`` bytes. The caller gives back ``len(body)`` when done with it."""
        if not request.body_exists:
            return b""
        # Room ahead for a declared length only: a body of unknown length takes room for its
        # bytes as they come (``take_arrived``). Idle chunked uploads holding a whole body's cap
        # each for a stall window, 16 a second, kept every other body of a Pylon waiting.
        room = 0 if request.content_length is None else request.content_length
        if room:
            await self.take(room)
        loop = asyncio.get_running_loop()
        window_end, window_from = loop.time() + self.stall_s, 0
        body = bytearray()
        try:
            while True:
                chunk: bytes | None
                if room > len(body) and self.capacity:  # room taken ahead: kept while bytes keep pace
                    try:
                        async with asyncio.timeout_at(window_end):
                            chunk = await request.content.readany()
                    except TimeoutError:
                        chunk = None
                    if loop.time() >= window_end:
                        if len(body) - window_from < MIN_BODY_RATE * self.stall_s:
                            self.give(room - len(body))
                            room = len(body)
                        window_end, window_from = loop.time() + self.stall_s, len(body)
                    if chunk is None:
                        continue
                else:
                    chunk = await request.content.readany()
                if not chunk:
                    break
                if len(body) + len(chunk) > cap:
                    raise PayloadTooLarge(f"request body is larger than {cap} bytes")
                body += chunk
                if len(body) > room:
                    if not self.take_arrived(len(body) - room):
                        await self.take(len(body) - room)
                    room = len(body)
        except BaseException:
            self.give(room)
            raise
        self.give(room - len(body))
        return bytes(body)

    def give(self, amount: int) -> None:
        self.used -= amount
        self._grant()

    def _grant(self) -> None:
        waiters = self._waiters
        while waiters:
            amount, waiter = waiters[0]
            if waiter.done():  # its wait ended (timed out, cancelled) before its task could leave
                waiters.popleft()
            elif self.used + amount <= self.capacity:
                waiters.popleft()
                self.used += amount
                waiter.set_result(None)
            else:
                return


UNCAPPED = BodyBudget(0, 0.0)
"""The budget of a hop configured without a cap: every take succeeds at once."""
