"""Suite-wide setup."""

from __future__ import annotations

import logging

from grpc import aio
from hypothesis import HealthCheck, settings

# Property and fuzz tests run the same examples on every machine (derandomized, no example database)
# and never fail on a slow example (no deadline): CI cannot flake on a newly drawn input. A local
# exploratory run can still pick ``--hypothesis-profile explore`` (random, more examples).
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, max_examples=1000)
settings.load_profile("ci")


def pytest_configure() -> None:
    # grpc.aio shuts its poller thread down whenever the last gRPC object is garbage-collected and
    # starts a new one with the next; that shutdown joins the poller, which can block the main thread
    # for seconds or hang (seen in whichever test the collector happened to run in). One reference
    # held for the whole session keeps a single poller alive from the first test to interpreter exit.
    aio.init_grpc_aio()


def _not_a_closed_loops_grpc_event(record: logging.LogRecord) -> bool:
    """The suite gives each test an event loop of its own, and the one gRPC poller serves them all:
    a completion for a call an earlier test started reaches its loop after that test closed it,
    and asyncio logs the poller's ``Event loop is closed`` in whichever test runs then. A single
    event loop (every process of the product) never sees it, so it is no finding of the test."""
    error = record.exc_info[1] if record.exc_info else None
    return not (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and "PollerCompletionQueue" in record.getMessage()
    )


logging.getLogger("asyncio").addFilter(_not_a_closed_loops_grpc_event)
