"""The one way a console script runs its event loop: uvloop when installed (0-11% less CPU), with
the process's open-file limit raised first; the one format of its log lines; and work that an
event cuts short (``unless_set``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

OPEN_FILES_CEILING = 1 << 20
LOW_OPEN_FILES = 4096
"""Below this many open files a process gets a startup warning: each request in flight holds two."""


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def unless_set(work: Awaitable[None], event: asyncio.Event) -> bool:
    """Run ``work`` unless ``event`` is set first (then cancel it): True when it completed; its
    error, if any, is raised."""
    task = asyncio.ensure_future(work)
    waiting = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, waiting), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiting.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()
    return True


def configure_logging(level: int | str) -> None:
    """Stderr, one format for every command: a fleet's lines can be put side by side in time."""
    logging.basicConfig(level=level, stream=sys.stderr, format=LOG_FORMAT)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def open_files_limit() -> int | None:
    """The soft limit on open files now; None where there is none."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def raise_open_files_limit() -> int | None:
    """Raise the soft limit on open files to the hard one, as Go's runtime does; the limit in force.

    A proxy holds two sockets per request in flight (its client's and its upstream's), so the
    common soft limit of 1024 failed the connections of a burst of ~500 requests, which the router
    then answered 503 as if every backend had refused them. ``None`` where there is no such limit.
    """
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CEILING)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):  # a platform cap below the hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    return soft


def ignore_hangup(loop: asyncio.AbstractEventLoop, logger: logging.Logger) -> None:
    """SIGHUP (``kill -HUP``, ``systemctl reload``, a closed terminal) is logged and ignored. Its
    default action killed the process at once, cutting every stream without the SIGTERM drain;
    nothing here reloads, so there is nothing else for it to do."""
    with contextlib.suppress(NotImplementedError, AttributeError):  # no SIGHUP (not POSIX)
        loop.add_signal_handler(
            signal.SIGHUP,
            logger.warning,
            "SIGHUP ignored: nothing is reloaded; restart to apply new settings (SIGTERM drains first)",
        )


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh loop (one event loop per process)."""
    limit = raise_open_files_limit()
    if limit is not None and limit < LOW_OPEN_FILES:
        logging.getLogger(__name__).warning(
            "open files are limited to %d (ulimit -n), so connections fail beyond about %d requests "
            "in flight; raise the hard limit",
            limit,
            limit // 2,
        )
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
