"""Suite-wide setup."""

from __future__ import annotations

from grpc import aio


def pytest_configure() -> None:
    # grpc.aio shuts its poller thread down whenever the last gRPC object is garbage-collected and
    # starts a new one with the next; that shutdown joins the poller, which can block the main thread
    # for seconds or hang (seen in whichever test the collector happened to run in). One reference
    # held for the whole session keeps a single poller alive from the first test to interpreter exit.
    aio.init_grpc_aio()
