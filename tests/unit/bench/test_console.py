"""The bench's event-loop runner: SIGTERM and Ctrl-C end a run as KeyboardInterrupt, quietly."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

import pytest

from stargate.bench.console import run_async


def test_sigterm_ends_the_run_as_keyboard_interrupt_after_teardown(caplog: pytest.LogCaptureFixture) -> None:
    torn_down: list[bool] = []

    async def run() -> None:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.Event().wait()  # until cancelled
        finally:
            await asyncio.sleep(0)  # a teardown that awaits, as the fleet's does
            torn_down.append(True)

    with pytest.raises(KeyboardInterrupt):
        run_async(run())
    gc.collect()  # a task that ended with the exception is reported when collected
    assert torn_down == [True]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_an_interrupt_that_lands_outside_the_run_leaves_no_task_exception_to_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ctrl-C raised in a callback (not in the run's task) ends the loop first; the run is then
    cancelled while asyncio closes, and a KeyboardInterrupt of its own was never retrieved."""
    torn_down: list[bool] = []

    def interrupt() -> None:
        raise KeyboardInterrupt

    async def run() -> None:
        asyncio.get_running_loop().call_soon(interrupt)
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            torn_down.append(True)

    with pytest.raises(KeyboardInterrupt):
        run_async(run())
    gc.collect()
    assert torn_down == [True]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
