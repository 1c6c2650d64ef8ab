"""What the request observer reports to the stats hub at each lifecycle transition (§10.3)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from stargate.pylon.models import Generation


class Endpoint(StrEnum):
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    COMPLETIONS = "completions"


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
    embedding_items: int | None = None
    streamed: bool = True  # False for a JSON answer: its times are the whole request, not TTFO/TTFT
    reported_input_tokens: int | None = None
    reported_cached_tokens: int | None = None

    @property
    def learnable_input_tokens(self) -> int:
        """The prompt tokens throughput learning may use: the client's claim, bounded by the
        engine's own count when its usage was seen (a claim can be anything)."""
        if self.reported_input_tokens is None:
            return self.input_tokens
        return min(self.input_tokens, self.reported_input_tokens)

    @property
    def uncached_input_tokens(self) -> int | None:
        """The prompt tokens the engine prefilled by its own usage (its prompt less what it had
        cached), bounded as the learnable tokens are; None when it reported no cached count."""
        if self.reported_input_tokens is None or self.reported_cached_tokens is None:
            return None
        uncached = max(0, self.reported_input_tokens - self.reported_cached_tokens)
        return min(self.learnable_input_tokens, uncached)


def embedding_item_count(body: Any) -> int | None:
    """Items of an embeddings request (§7.1): a string is 1, a token array (numbers) is 1, another
    array counts its elements (``[]`` is 0); a missing or other ``input`` is unknown (None)."""
    if not isinstance(body, dict):
        return None
    items = body.get("input")
    if isinstance(items, str):
        return 1
    if not isinstance(items, list):
        return None
    if items and all(isinstance(i, int | float) and not isinstance(i, bool) for i in items):
        return 1
    return len(items)
