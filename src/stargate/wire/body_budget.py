"""A process-wide cap on the request-body bytes Stargate or Pylon holds in memory at once.

Each hop caps one body (Stargate's replay buffer, its plain-client read, Pylon's read), but not
their sum: 40 streamed requests of 50 MB took Stargate to 3 GB and each Pylon to 2 GB, so a single
client could exhaust the machine's memory and take every request in flight down with the process.
Bodies read whole wait (first come, first served) for room, so their memory is bounded and the
requests are delayed, not lost; a wait longer than ``wait_s`` (None: no limit) ends in
``BodyBufferFull``. A body only kept for replay takes room without waiting and is not kept when
there is none (the request goes on, without retries that need its body), as Envoy does past its
buffer limit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from aiohttp import web

from stargate.errors import BodyBufferFull


class BodyBudget:
    """Room for ``capacity`` bytes of request bodies (0 = no cap), shared by a process's requests.

    A caller takes its whole amount at once and gives it back when done: no request holds part of
    the room while it waits for the rest, so waiters cannot block each other for ever.
    """

    def __init__(self, capacity: int, wait_s: float | None) -> None:
        self.capacity = capacity
        self.wait_s = wait_s
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

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
                self._waiters.remove(entry)
                self._grant()  # those behind may fit now
            if isinstance(exc, TimeoutError):  # only a set wait times out
                raise BodyBufferFull(
                    f"request bodies held in memory are at the limit of {self.capacity} bytes and "
                    f"none finished within {self.wait_s:g} s"
                ) from None
            raise

    async def read_whole(
        self, request: web.BaseRequest, cap: int, read: Callable[[], Awaitable[bytes]]
    ) -> bytes:
        """``read()`` the request's body, holding room for it: its declared length (``cap`` when it
        declares none, nothing without a body) is taken before the first byte is read, the rest
        given back once it is in. The caller gives back ``len(body)`` when done with it."""
        declared = request.content_length
        room = (cap if declared is None else declared) if request.body_exists else 0
        await self.take(room)
        try:
            body = await read()
        except BaseException:
            self.give(room)
            raise
        self.give(room - len(body))
        return body

    def give(self, amount: int) -> None:
        self.used -= amount
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            amount, waiter = self._waiters.popleft()
            self.used += amount
            waiter.set_result(None)


UNCAPPED = BodyBudget(0, 0.0)
"""The budget of a hop configured without a cap: every take succeeds at once."""
