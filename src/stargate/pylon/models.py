"""Model generations and their lifecycle (spec pylon.md §1 "model generation", §3 step 8, §4).

A generation is ``(model_id, seq)`` with ``seq`` increasing per process from 1. A model that is
removed and re-added gets a new generation; all stats and queue entries are scoped to it.
Only *published* generations are advertised and routable; a retired generation can never be
published again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


@dataclass(frozen=True, slots=True)
class Generation:
    model_id: str
    seq: int


class ModelStatus(IntEnum):
    """Wire values of ``InferenceServerStatus``."""

    UNKNOWN = 0
    ACTIVE = 1
    INACTIVE = 2


@dataclass(slots=True)
class _Entry:
    generation: Generation
    published: bool = False
    bringup_ready: bool = True


class ModelRegistry:
    """Current generation per model id; the single source of truth for routability."""

    def __init__(self) -> None:
        self._next_seq = 1
        self._entries: dict[str, _Entry] = {}

    def allocate(self, model_id: str) -> Generation:
        """Register a new pending generation, replacing (retiring) any current one."""
        gen = Generation(model_id, self._next_seq)
        self._next_seq += 1
        self._entries[model_id] = _Entry(gen)
        return gen

    def publish(self, gen: Generation) -> bool:
        entry = self._entries.get(gen.model_id)
        if entry is None or entry.generation != gen:
            return False
        entry.published = True
        return True

    def retire(self, model_id: str) -> Generation | None:
        entry = self._entries.pop(model_id, None)
        return entry.generation if entry is not None else None

    def current(self, model_id: str) -> Generation | None:
        entry = self._entries.get(model_id)
        return entry.generation if entry is not None else None

    def is_current(self, gen: Generation) -> bool:
        entry = self._entries.get(gen.model_id)
        return entry is not None and entry.generation == gen

    def admitted(self, model_id: str) -> Generation | None:
        entry = self._entries.get(model_id)
        return entry.generation if entry is not None and entry.published else None

    def set_bringup_ready(self, gen: Generation, ready: bool) -> None:
        entry = self._entries.get(gen.model_id)
        if entry is not None and entry.generation == gen:
            entry.bringup_ready = ready

    def model_ids(self) -> list[str]:
        return sorted(self._entries)

    def published(self) -> list[tuple[Generation, ModelStatus]]:
        """Advertised generations in model order with their status."""
        return [
            (e.generation, ModelStatus.ACTIVE if e.bringup_ready else ModelStatus.INACTIVE)
            for _, e in sorted(self._entries.items())
            if e.published
        ]
