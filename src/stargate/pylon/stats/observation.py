"""What the request observer reports to the stats hub at each lifecycle transition (§10.3)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from stargate.pylon.models import Generation


class Endpoint(StrEnum):
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"


class State(StrEnum):
    UPSTREAM_CONNECTING = "upstream_connecting"
    INPUT_PROCESSING = "input_processing"
    OUTPUT_GENERATION = "output_generation"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (State.COMPLETE, State.FAILED, State.CANCELLED)


@dataclass(frozen=True, slots=True)
class Observation:
    """Times are seconds since the request was accepted; None = not reached yet."""

    request_id: str
    generation: Generation
    endpoint: Endpoint
    state: State
    input_tokens: int
    output_tokens: int = 0
    output_tokens_from_chunk_usage: bool = False
    time_to_response_headers: float | None = None
    time_to_first_output: float | None = None
    time_to_first_token: float | None = None
    elapsed: float = 0.0
    calibration: bool = False
    upstream_status: int | None = None
