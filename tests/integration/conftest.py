"""Fixtures shared by the integration tests: Pylon's fake engine and fake Stargate, stopped at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from support.pylon_fakes import FakeEngine, FakeStargate


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    e = await FakeEngine().start()
    try:
        yield e
    finally:
        await e.close()


@pytest.fixture
async def stargate() -> AsyncIterator[FakeStargate]:
    s = await FakeStargate().start()
    try:
        yield s
    finally:
        await s.close()
