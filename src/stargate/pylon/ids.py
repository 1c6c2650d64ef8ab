"""Self-generated request ids ``<kind>-<uuid>-g<generation>-<counter>`` (spec pylon.md §5.2).

The UUID is fixed per process and the counter is process-wide from 1; an id counts as
self-generated only when its UUID is this process's.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass

CALIBRATION = "calibration"
CANARY = "canary"


@dataclass(frozen=True, slots=True)
class GeneratedId:
    kind: str
    generation_seq: int
    counter: int


class RequestIds:
    def __init__(self, process_uuid: str | None = None) -> None:
        self.uuid = process_uuid or str(uuid.uuid4())
        self._counter = itertools.count(1)
        # Built once: ``parse`` runs on every engine stats event.
        self._prefixes = tuple((kind, f"{kind}-{self.uuid}-g") for kind in (CALIBRATION, CANARY))

    def new(self, kind: str, generation_seq: int) -> str:
        return f"{kind}-{self.uuid}-g{generation_seq}-{next(self._counter)}"

    def parse(self, request_id: str) -> GeneratedId | None:
        for kind, prefix in self._prefixes:
            if request_id.startswith(prefix):
                seq, sep, counter = request_id[len(prefix) :].partition("-")
                if sep and seq.isdigit() and counter.isdigit():
                    return GeneratedId(kind, int(seq), int(counter))
        return None
