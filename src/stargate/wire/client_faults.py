"""Client-caused faults: one WARNING line each, no traceback, rate-limited per kind.

A client may send malformed HTTP, hang up mid-request or trickle its request head as often as it
likes; none of that is the fleet's fault, and none of it may flood the log or bury the errors that
are. Each kind of fault has a token bucket (``burst`` lines at once, refilled at ``per_s`` lines a
second); the first line after a suppressed stretch is preceded by one saying how many similar lines
were dropped. Memory is fixed: one bucket per kind, no per-client state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

MAX_DETAIL_CHARS = 160


class Fault(Enum):
    """The kinds of client-caused fault; each has its own rate limit."""

    MALFORMED = "malformed request"
    REQUEST_ABANDONED = "client closed before its request was complete"
    RESPONSE_ABANDONED = "client closed before the response was complete"
    SLOW_HEAD = "request head not complete in time"
    SLOW_BODY = "request body stalled"
    SLOW_READER = "answer not read"
    CROWDED = "client connections near the open-file limit"


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float
    suppressed: int = 0


class ClientFaults:
    """Logs client-caused faults on ``logger`` at WARNING, at most ``burst`` then ``per_s`` a second
    per kind. ``clock`` is monotonic seconds (injected so tests drive the refill)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        per_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self._burst = float(burst)
        self._per_s = per_s
        self._clock = clock
        now = clock()
        self._buckets = {fault: _Bucket(self._burst, now) for fault in Fault}

    def report(self, fault: Fault, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``fault``'s bucket is empty; True when it was logged."""
        bucket, now = self._buckets[fault], self._clock()
        bucket.tokens = min(self._burst, bucket.tokens + max(0.0, now - bucket.updated) * self._per_s)
        bucket.updated = now
        if bucket.tokens < 1.0:
            bucket.suppressed += 1
            return False
        bucket.tokens -= 1.0
        if bucket.suppressed:
            self.logger.warning("suppressed %d similar messages (%s)", bucket.suppressed, fault.value)
            bucket.suppressed = 0
        self.logger.warning(message, *args)
        return True


def detail(text: object) -> str:
    """``text`` on one short line: client bytes end up in these messages, never a forged log line."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(text).split()))
    return flat if len(flat) <= MAX_DETAIL_CHARS else flat[: MAX_DETAIL_CHARS - 3] + "..."
