"""Request observer: lifecycle timing and cheap SSE scanning while bytes are relayed (§10).

The relay forwards upstream chunks untouched; ``SseScanner`` only looks at them. Before the
first output message it splits events to classify them (``[DONE]``, empty data and
``response.created`` are not output). Afterwards it only counts cheap byte markers per chunk
and parses an event as JSON only when it carries a usage counter (``…_tokens"``), which is
normally the final chunk. Token estimates count non-empty ``"content"``/``"delta"`` string
fields (one per streamed piece) until an explicit counter replaces them.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from stargate.pylon.models import Generation
from stargate.pylon.stats.observation import Endpoint, Observation, State
from stargate.wire.clock import Clock
from stargate.wire.sse import Delivered, event_data, is_answer, is_output, iter_events, split_complete

PROGRESS_INTERVAL_S = 1.0
_TEXT_MARKERS = (b'"content":"', b'"content": "', b'"delta":"', b'"delta": "')
_EMPTY_MARKERS = (b'"content":""', b'"content": ""', b'"delta":""', b'"delta": ""')
_MARKER_PAIRS = tuple(zip(_TEXT_MARKERS, _EMPTY_MARKERS, strict=True))
# /v1/completions chunks carry their text in "text" (chat and responses use content/delta).
_COMPLETION_PAIRS = ((b'"text":"', b'"text":""'), (b'"text": "', b'"text": ""'))


def _uint(value: object) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _explicit_counters(data: bytes) -> tuple[int | None, int | None, int | None]:
    """``(output, prompt, cached)`` usage counters of one event (or of a whole JSON answer).

    Output: first of ``usage.completion_tokens``, ``output_tokens_so_far``,
    ``response.usage.output_tokens``, ``usage.output_tokens`` (a ``/v1/responses`` JSON answer);
    prompt: ``usage.prompt_tokens``, ``response.usage.input_tokens`` or ``usage.input_tokens`` (the
    engine's own count, which bounds a client's claim); cached: the ``cached_tokens`` of the
    prompt's details in the same usage (``prompt_tokens_details``, ``input_tokens_details``), which
    vLLM and SGLang can report: that part of the prompt was not prefilled.
    """
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, None, None
    if not isinstance(obj, dict):
        return None, None, None
    usage = obj.get("usage")
    response = obj.get("response")
    response_usage = response.get("usage") if isinstance(response, dict) else None
    outputs: list[object] = []
    prompt: int | None = None
    cached: int | None = None
    if isinstance(usage, dict):
        outputs.append(usage.get("completion_tokens"))
        prompt, cached = _uint(usage.get("prompt_tokens")), _cached(usage, "prompt_tokens_details")
    outputs.append(obj.get("output_tokens_so_far"))
    for source in (response_usage, usage):  # a Responses stream's, else a Responses JSON answer's
        if isinstance(source, dict):
            outputs.append(source.get("output_tokens"))
            if prompt is None:
                prompt, cached = _uint(source.get("input_tokens")), _cached(source, "input_tokens_details")
    output = next((v for value in outputs if (v := _uint(value)) is not None), None)
    return output, prompt, cached if prompt is not None else None


def _cached(usage: dict[str, object], details: str) -> int | None:
    value = usage.get(details)
    return _uint(value.get("cached_tokens")) if isinstance(value, dict) else None


def json_usage(body: bytes) -> tuple[int | None, int | None, int | None]:
    """``(output, prompt, cached)`` tokens of a whole JSON answer (non-streaming chat,
    completions, responses)."""
    return _explicit_counters(body)


class SseScanner:
    def __init__(self, *, completions: bool = False) -> None:
        self._pairs = _COMPLETION_PAIRS if completions else _MARKER_PAIRS
        self._tail = b""
        self.output_seen = False
        self.answered = False
        """An event of an answer arrived (``wire.sse.is_answer``), output or not."""
        self.estimated_tokens = 0
        self.explicit_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None

    @property
    def tokens(self) -> int:
        return self.explicit_tokens if self.explicit_tokens is not None else self.estimated_tokens

    def feed(self, chunk: bytes) -> bool:
        """Scan one chunk; True when the first output message completed in it."""
        complete, self._tail = split_complete(self._tail + chunk if self._tail else chunk)
        if not complete:
            return False
        first = False
        if not self.output_seen:
            consumed = 0
            for raw in iter_events(complete):
                consumed += len(raw)
                self.answered = self.answered or is_answer(raw)
                if is_output(raw):
                    self.output_seen = first = True
                    self._count(raw)
                    break
            else:
                return False
            complete = complete[consumed:]
        if b'_tokens"' in complete or b"_so_far" in complete:
            for raw in iter_events(complete):
                self._count(raw)
        elif complete:
            # No usage counter here: counting the events together equals counting them one by one.
            self._count(complete)
        return first

    def _count(self, raw: bytes) -> None:
        if b'_tokens"' in raw or b"_so_far" in raw:
            _, data = event_data(raw)
            value, prompt, cached = _explicit_counters(data)
            if prompt is not None:
                self.prompt_tokens, self.cached_tokens = prompt, cached
            if value is not None:
                self.explicit_tokens = max(value, self.explicit_tokens or 0)
                return
        if self.explicit_tokens is None:
            self.estimated_tokens += max(_pieces(raw, self._pairs), 0)


def _pieces(raw: bytes, pairs: tuple[tuple[bytes, bytes], ...]) -> int:
    """Non-empty text markers; an empty marker is only looked for where its text marker occurs."""
    pieces = 0
    for text, empty in pairs:
        found = raw.count(text)
        if found:
            pieces += found - raw.count(empty)
    return pieces


class RequestObserver:
    """Tracks one request's lifecycle and reports observations at transitions (and ≤ 1/s progress)."""

    def __init__(
        self,
        *,
        request_id: str,
        generation: Generation,
        endpoint: Endpoint,
        input_tokens: int,
        clock: Clock,
        sink: Callable[[Observation], None],
        calibration: bool = False,
    ) -> None:
        self.request_id = request_id
        self.generation = generation
        self.endpoint = endpoint
        self.input_tokens = input_tokens
        self._clock = clock
        self._sink = sink
        self._calibration = calibration
        self._t0 = clock.monotonic()
        self.state = State.UPSTREAM_CONNECTING
        self.status: int | None = None
        self.ttrh: float | None = None
        self.ttfo: float | None = None
        self.ttft: float | None = None
        self.output_tokens = 0
        self.from_chunk_usage = False
        self.embedding_items: int | None = None  # set by the relay from an embeddings body
        self.streamed = True  # the relay clears it for a JSON answer
        self.reported_input_tokens: int | None = None  # the engine's usage.prompt_tokens, if seen
        self.reported_cached_tokens: int | None = None  # of those, what it had cached, if it said
        self.delivered = Delivered()  # what the client has been sent of a stream, fed by the relay
        self._last_progress = 0.0
        self._emit()

    def _elapsed(self) -> float:
        return self._clock.monotonic() - self._t0

    def _emit(self) -> None:
        self._sink(
            Observation(
                request_id=self.request_id,
                generation=self.generation,
                endpoint=self.endpoint,
                state=self.state,
                input_tokens=self.input_tokens,
                output_tokens=self.output_tokens,
                output_tokens_from_chunk_usage=self.from_chunk_usage,
                time_to_response_headers=self.ttrh,
                time_to_first_output=self.ttfo,
                time_to_first_token=self.ttft,
                elapsed=self._elapsed(),
                calibration=self._calibration,
                upstream_status=self.status,
                embedding_items=self.embedding_items,
                streamed=self.streamed,
                reported_input_tokens=self.reported_input_tokens,
                reported_cached_tokens=self.reported_cached_tokens,
            )
        )

    def headers(self, status: int) -> None:
        if self.state is not State.UPSTREAM_CONNECTING:
            return
        self.status = status
        self.ttrh = self._elapsed()
        self.state = State.INPUT_PROCESSING
        self._emit()

    def output(self, tokens: int, *, explicit: bool = False) -> None:
        """Output progress: cumulative ``tokens`` (explicit = from a usage counter)."""
        if self.state.terminal:
            return
        now = self._elapsed()
        self.output_tokens = tokens
        self.from_chunk_usage = self.from_chunk_usage or explicit
        if self.ttft is None and tokens > 0:
            self.ttft = now
        if self.state is not State.OUTPUT_GENERATION:
            self.ttfo = now
            self.state = State.OUTPUT_GENERATION
            self._last_progress = now
            self._emit()
        elif now - self._last_progress >= PROGRESS_INTERVAL_S:
            self._last_progress = now
            self._emit()

    def finish(self, failed: bool = False) -> State:
        if self.state.terminal:
            return self.state
        ok = self.status is not None and 200 <= self.status < 300
        if failed or self.state is State.UPSTREAM_CONNECTING:
            self.state = State.FAILED
        elif self.state is State.OUTPUT_GENERATION:
            self.state = State.COMPLETE if ok else State.FAILED
        else:
            self.state = State.COMPLETE if ok and self.endpoint is Endpoint.EMBEDDINGS else State.FAILED
        self._emit()
        return self.state

    def cancel(self) -> None:
        if not self.state.terminal:
            self.state = State.CANCELLED
            self._emit()
