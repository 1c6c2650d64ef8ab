"""Bounded waits for conditions a test cannot drive directly (real sockets, real processes).

Time that a test can drive goes through ``stargate.wire.clock.ManualClock`` instead; these helpers
are for state that another task or process reaches on its own. Every wait has a deadline and fails
with what it waited for, so a missed condition is an assertion, never a hang.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 10.0
INTERVAL_S = 0.01


async def value_of(
    what: str,
    probe: Callable[[], T | Awaitable[T | None] | None],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = INTERVAL_S,
    details: Callable[[], str] | None = None,
) -> T:
    """The first result of ``probe()`` that is not None or False (sync or async probe).

    ``details`` adds context to the failure (process log tails, the last value seen).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if inspect.isawaitable(result):
            result = await result
        if result is not None and result is not False:
            return result  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{extra}")
        await asyncio.sleep(interval_s)


async def until(
    what: str,
    check: Callable[[], bool | Awaitable[bool]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = INTERVAL_S,
    details: Callable[[], str] | None = None,
) -> float:
    """Wait until ``check()`` holds; returns the seconds it took."""
    started = time.monotonic()
    await value_of(what, check, timeout_s=timeout_s, interval_s=interval_s, details=details)
    return time.monotonic() - started
