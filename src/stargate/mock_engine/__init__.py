"""Mock OpenAI-compatible inference engine with a deterministic timing and KV-cache model.

Public API: :class:`~stargate.mock_engine.engine.EngineConfig`, :class:`~stargate.mock_engine.engine.Engine`,
:class:`~stargate.mock_engine.timing.TimingConfig`, :func:`~stargate.mock_engine.app.build_app`,
:func:`~stargate.mock_engine.app.start_server` and the ``stargate-mock-engine`` command
(:func:`~stargate.mock_engine.cli.main`).
"""

from __future__ import annotations

from .app import build_app, start_server
from .engine import Engine, EngineConfig
from .timing import TimingConfig

__all__ = ["Engine", "EngineConfig", "TimingConfig", "build_app", "start_server"]
