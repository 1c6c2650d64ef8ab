"""Where compressed request bodies are decoded: the threads ``decoded`` runs in."""

from __future__ import annotations

import threading

import pytest

from stargate.body_coding import decoded


def decoding_threads(monkeypatch: pytest.MonkeyPatch, module: str) -> list[int]:
    """Patch ``module``'s ``decoded`` to record the thread of each call (the list it fills)."""
    threads: list[int] = []

    def recorded(body: bytes, coding: str | None, limit: int) -> bytes:
        threads.append(threading.get_ident())
        return decoded(body, coding, limit)

    monkeypatch.setattr(f"{module}.decoded", recorded)
    return threads
