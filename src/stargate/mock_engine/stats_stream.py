"""Engine stats NDJSON stream for Pylon (mock-engine spec §5.3, pylon spec §6.2).

Events are broadcast to every subscriber connected at emission time; a subscriber more than
``SUBSCRIBER_BACKLOG`` lines behind loses the oldest ones. With no subscriber an event costs one
attribute check. Pings go out on connect and every second; when the engine's concurrency limit is
known they advertise it (``model`` + ``max_engine_concurrency``, the seed PR's ping extension). A
test-control override (``PUT /test-control/models/{model}`` with ``max_engine_concurrency``) replaces
the advertised value from the next ping on; an override of 0 is sent explicitly (a withdrawal).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Mapping

import orjson
from aiohttp import web

SUBSCRIBER_BACKLOG = 1024
MAX_SUBSCRIBERS = 64
PING_INTERVAL_S = 1.0


def stats_line(request_id: str, model: str, processed: int, generated: int | None, finished: bool) -> bytes:
    """One stats line: keys type, v, request_id, model, counters; absent ``finished`` means false."""
    line = b'{"type":"stats","v":1,"request_id":%s,"model":%s,"tokens_processed":%d' % (
        orjson.dumps(request_id),
        orjson.dumps(model),
        processed,
    )
    if generated is not None:
        line += b',"tokens_generated":%d' % generated
    if finished:
        line += b',"finished":true'
    return line + b"}\n"


def ping_line(model: str, max_engine_concurrency: int) -> bytes:
    if max_engine_concurrency > 0:
        return b'{"type":"ping","v":1,"model":%s,"max_engine_concurrency":%d}\n' % (
            orjson.dumps(model),
            max_engine_concurrency,
        )
    return b'{"type":"ping","v":1}\n'


def override_ping_line(model: str, max_engine_concurrency: int) -> bytes:
    """A ping that always names the model and the limit, 0 included (the engine withdraws it)."""
    return b'{"type":"ping","v":1,"model":%s,"max_engine_concurrency":%d}\n' % (
        orjson.dumps(model),
        max_engine_concurrency,
    )


class _Subscriber:
    __slots__ = ("lines", "wake")

    def __init__(self) -> None:
        self.lines: deque[bytes] = deque(maxlen=SUBSCRIBER_BACKLOG)
        self.wake = asyncio.Event()


class StatsHub:
    def __init__(
        self, model: str, max_engine_concurrency: int, limit_overrides: Mapping[str, int] | None = None
    ) -> None:
        self._subscribers: list[_Subscriber] = []
        self._model = model
        self._ping = ping_line(model, max_engine_concurrency)
        self._overrides: Mapping[str, int] = {} if limit_overrides is None else limit_overrides

    def current_ping(self) -> bytes:
        """The configured ping unless test control overrides this model's limit (read live)."""
        override = self._overrides.get(self._model)
        return self._ping if override is None else override_ping_line(self._model, override)

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def emit(
        self, request_id: str, model: str, processed: int, generated: int | None, finished: bool = False
    ) -> None:
        if not self._subscribers:
            return
        line = stats_line(request_id, model, processed, generated, finished)
        for subscriber in self._subscribers:
            subscriber.lines.append(line)
            subscriber.wake.set()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if len(self._subscribers) >= MAX_SUBSCRIBERS:
            raise web.HTTPServiceUnavailable(text="too many stats stream subscribers")
        response = web.StreamResponse(headers={"content-type": "application/x-ndjson"})
        try:
            await response.prepare(request)
        except ConnectionError:  # the subscriber left before its headers went out
            return response
        subscriber = _Subscriber()
        self._subscribers.append(subscriber)
        loop = asyncio.get_running_loop()
        try:
            await response.write(self.current_ping())
            next_ping = loop.time() + PING_INTERVAL_S
            while True:
                timeout = next_ping - loop.time()
                if timeout > 0 and not subscriber.lines:
                    subscriber.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(subscriber.wake.wait(), timeout)
                if subscriber.lines:
                    batch = b"".join(subscriber.lines)
                    subscriber.lines.clear()
                    await response.write(batch)
                now = loop.time()
                if now >= next_ping:
                    await response.write(self.current_ping())
                    while next_ping <= now:  # missed ticks are skipped, not replayed
                        next_ping += PING_INTERVAL_S
        except ConnectionError:
            pass
        finally:
            self._subscribers.remove(subscriber)
        return response
