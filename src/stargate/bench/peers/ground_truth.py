"""Join the mock engines' ground-truth request log onto the driver's records.

Every engine of a comparison run appends one JSON line per finished request to the run's
``ground-truth.jsonl`` (``--request-log``). The join is on ``x-request-id``, which every router here
forwards, so which engine served a request and whether its KV cache hit come from the engine itself,
never from what a router passes back. A record of a router without Pylons has no
``x-inference-server-id``; its backend is then named after the engine (``engine-N`` serves the cluster
whose first backend is ``backend-N``), which is exact for one Pylon per cluster only: such a run is
scored over the engines (``score.summarize(pylons_in_path=False)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from stargate.bench.score import RequestRecord

GROUND_TRUTH_FILE = "ground-truth.jsonl"
MAX_LINES = 5_000_000


def read_ground_truth(path: Path) -> dict[str, dict[str, Any]]:
    """request id → its engine line (the last one wins); a missing file is an empty map."""
    rows: dict[str, dict[str, Any]] = {}
    try:
        handle = path.open("rb")
    except OSError:
        return rows
    with handle:
        for count, line in enumerate(handle):
            if count >= MAX_LINES:
                break
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # a line cut by a killed engine
            if isinstance(row, dict) and isinstance(row.get("request_id"), str):
                rows[row["request_id"]] = row
    return rows


def _backend_of(engine_id: str) -> str:
    return "backend-" + engine_id.removeprefix("engine-") if engine_id.startswith("engine-") else engine_id


def apply_ground_truth(
    records: Sequence[RequestRecord], truth: dict[str, dict[str, Any]]
) -> list[RequestRecord]:
    """Records with engine, cache hit and reuse taken from the engines' own log where it has the id."""
    joined: list[RequestRecord] = []
    for record in records:
        row = truth.get(record.request_id)
        if row is None:
            joined.append(record)
            continue
        engine = str(row.get("backend_id") or record.engine_id or "")
        joined.append(
            dataclasses.replace(
                record,
                engine_id=engine or record.engine_id,
                backend_id=record.backend_id or (_backend_of(engine) if engine else None),
                cache_hit=bool(row.get("hit")),
                cache_hit_tokens=int(row.get("hit_tokens") or 0),
                evicted_entries=int(row.get("evicted_entries") or 0),
                evicted_tokens=int(row.get("evicted_tokens") or 0),
            )
        )
    return joined
