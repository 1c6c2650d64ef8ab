"""The generating endpoints: chat completions, completions and responses (streaming or JSON).

Timeline of one request (docs/mock-engine.md): count and hold → failure switches and injected
faults → token counts → wait for a slot (vllm mode: for admission) → stats ``(0,0)`` (streaming)
→ KV access → prefill of the uncached tokens → KV commit → injected delay → response headers →
first-token delay → tokens on absolute deadlines (the per-token overhead never accumulates; vllm
mode: one per engine step) → finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal

import orjson
from aiohttp import web

from stargate.wire import headers as h
from stargate.wire import json_body

from . import openai_format as fmt
from . import tokens as tok
from .control import Failure, request_class
from .engine import Engine, Seat
from .kv_cache import NO_EVICTION, Eviction, Lookup
from .request_body import read_body
from .request_log import RequestRecord
from .scheduler import Decode
from .steps import QueueFull
from .timing import first_token_delay_s

Kind = Literal["chat", "completions", "responses"]
_ENDPOINT = {"chat": "chat_completions", "completions": "completions", "responses": "responses"}
_ID_PREFIX = {"chat": "chatcmpl-mock-", "completions": "cmpl-mock-", "responses": "resp-mock-"}
_last_ns = 0


def new_id(prefix: str) -> str:
    """``prefix`` + hex nanoseconds, strictly increasing within the process."""
    global _last_ns
    _last_ns = max(time.time_ns(), _last_ns + 1)
    return f"{prefix}{_last_ns:x}"


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    body = orjson.dumps({"error": {"message": message, "code": status}})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def failure_response(failure: Failure, message: str = "mock injected failure") -> web.Response:
    headers: dict[str, str] = {}
    if failure.retryable:
        headers[h.UPSTREAM_RETRYABLE] = "true"
    if failure.retry_after_s is not None:
        headers["retry-after"] = str(failure.retry_after_s)
    return error_response(failure.status, message, headers)


def queue_full_response(engine: Engine) -> web.Response:
    """A retryable 429 that says which limit refused the request, so it is not taken for a fault."""
    limit = engine.config.max_waiting_requests
    return failure_response(Failure(429, True, 1), f"waiting queue full (--max-waiting-requests {limit})")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The JSON object body: 415 without a JSON content type or in a coding not supported, 413
    declared larger than the limit (before it is sent) or decoding past it, 400 malformed or not
    decodable, 422 not an object."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="expected content-type: application/json")
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    raw = await read_body(request)
    try:
        body = json_body.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"malformed JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPUnprocessableEntity(text="request body must be a JSON object")
    return body


def _field_error(name: str, expected: str) -> web.HTTPUnprocessableEntity:
    return web.HTTPUnprocessableEntity(text=f"field {name!r} must be {expected}")


def resolve_model(engine: Engine, body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return engine.config.model
    if not isinstance(model, str):
        raise _field_error("model", "a string")
    return model or engine.config.model


def _input_tokens(engine: Engine, kind: Kind, body: dict[str, Any], header: int | None) -> tuple[int, bytes]:
    """(input tokens, prompt bytes); the prompt bytes are built only in prefix KV mode."""
    prefix_mode = engine.kv.mode == "prefix"
    if kind == "chat":
        value = body.get("messages", [])
        prompt = tok.chat_prompt_bytes(value) if prefix_mode else b""
    else:
        value = body.get("prompt" if kind == "completions" else "input")
        prompt = tok.raw_prompt_bytes(value) if prefix_mode else b""
        if prefix_mode and kind == "responses":
            prompt = tok.instructions_bytes(body.get("instructions")) + prompt
    if header is not None:
        return max(1, header), prompt
    if prefix_mode:
        return tok.text_token_estimate(prompt), prompt
    if kind == "chat":
        return tok.chat_input_estimate(value), prompt
    if kind == "completions":
        return tok.completions_input_estimate(value), prompt
    try:
        return tok.responses_input_estimate(value), prompt
    except TypeError:  # the estimate is compact JSON's length, and orjson writes 255 levels at most
        raise _field_error("input", "nested at most 255 levels deep") from None


def _validate(kind: Kind, body: dict[str, Any]) -> Any:
    if kind == "chat" and not isinstance(body.get("messages", []), list):
        raise _field_error("messages", "an array")
    limit_name = "max_output_tokens" if kind == "responses" else "max_tokens"
    limit = body.get(limit_name)
    if kind == "chat" and limit is None:
        limit_name = "max_completion_tokens"
        limit = body.get(limit_name)
    # 0 is answered with one token, as the original does (tokens.output_tokens)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise _field_error(limit_name, "a non-negative integer")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _field_error("stream_options", "an object")
    choices = body.get("n")
    if kind != "responses" and choices is not None:
        if not isinstance(choices, int) or isinstance(choices, bool) or choices < 1:
            raise _field_error("n", "a positive integer")
        if choices > 1:  # one choice silently would break a client that reads choices[1]
            raise web.HTTPBadRequest(text="n > 1 is not supported: the mock engine generates one choice")
    return limit


def kv_headers(engine: Engine, lookup: Lookup, eviction: Eviction, inp: int, out: int) -> dict[str, str]:
    return {
        h.KV_CACHE_HIT: "true" if lookup.hit else "false",
        h.KV_CACHE_EVICTED_ENTRIES: str(eviction.entries),
        h.KV_CACHE_EVICTED_TOKENS: str(eviction.tokens),
        h.KV_CACHE_REUSED_INPUT_TOKENS: str(lookup.reused),
        h.KV_CACHE_UNCACHED_INPUT_TOKENS: str(lookup.uncached),
        h.MOCK_INPUT_TOKENS: str(inp),
        h.MOCK_OUTPUT_TOKENS: str(out),
    }


async def generate(engine: Engine, request: web.Request, kind: Kind) -> web.StreamResponse:
    arrival = engine.clock()
    body = await read_json(request)
    model = resolve_model(engine, body)
    stream = body.get("stream") is True
    if kind == "responses" and not stream and engine.config.responses_stream_only:
        return web.json_response({"error": "mock-dynamo /v1/responses requires stream=true"}, status=400)
    limit = _validate(kind, body)
    headers_in = request.headers
    header_id = headers_in.get(h.REQUEST_ID, "")
    ident = new_id(_ID_PREFIX[kind])
    request_id = header_id or ("" if kind == "responses" else ident)
    if engine.arrivals is not None:
        engine.arrivals.add(request_id, engine.to_wall(arrival))
    control = engine.control
    klass = request_class(header_id)
    control.count(_ENDPOINT[kind], model, klass)
    await control.bringup_hold(model, klass)
    if kind == "chat" and control.chat_failure(model):
        return error_response(503, f"mock chat failure enabled for model {model}")
    plan = control.faults.take()
    if plan.failure is not None:
        return failure_response(plan.failure)
    if control.paused:
        await control.wait_resumed()
    record = RequestRecord(request_id, _ENDPOINT[kind], model, engine.to_wall(arrival), stream)
    input_tokens, prompt = _input_tokens(
        engine, kind, body, tok.parse_token_header(headers_in.get(h.INPUT_TOKENS))
    )
    output_tokens = tok.output_tokens(
        tok.parse_token_header(headers_in.get(h.OUTPUT_TOKENS)), limit, engine.timing.num_tokens
    )
    if input_tokens > engine.config.max_model_len:  # vLLM refuses it too; it would hold the engine for ages
        record.status, record.outcome = 400, "prompt_too_long"
        log_request(engine, record)
        return error_response(
            400,
            f"This model's maximum context length is {engine.config.max_model_len} "
            f"tokens. However, you requested {input_tokens} tokens in the prompt.",
        )
    admit = _Admit(engine, record, headers_in.get(h.CACHE_AFFINITY_KEY), prompt, input_tokens, output_tokens)
    immediate = plan.delay_s <= 0 and first_token_delay_s(engine.timing, request_id) <= 0
    try:
        seat = await engine.enter(admit, immediate=immediate, scheduled=admit.scheduled)
    except QueueFull:
        record.status, record.outcome = 429, "queue_full"
        log_request(engine, record)
        return queue_full_response(engine)
    try:
        await engine.prefill_seat(seat)
        engine.prompt_tokens_total += input_tokens
        record.prefill_ms = (engine.clock() - admit.prefill_start) * 1000.0
        lookup = admit.lookup
        eviction = admit.evicted(engine.kv.commit(lookup, input_tokens))
        record.hit, record.hit_tokens = lookup.hit, lookup.reused
        record.evicted_entries, record.evicted_tokens = eviction.entries, eviction.tokens
        if plan.delay_s > 0:
            await engine.sleep(plan.delay_s)
        headers = kv_headers(engine, lookup, eviction, input_tokens, output_tokens)
        if stream:
            return await _stream(
                engine,
                request,
                kind,
                body,
                ident,
                request_id,
                model,
                headers,
                record,
                plan.drop_after_chunks,
                seat,
            )
        return await _respond(
            engine, request, kind, ident, request_id, model, headers, record, plan.drop_after_chunks, seat
        )
    except asyncio.CancelledError:
        record.status, record.outcome = 499, "client_disconnected"
        raise
    finally:
        engine.leave(seat)
        if record.finish is None:
            record.finish = engine.to_wall(engine.clock())
        log_request(engine, record)


class _Admit:
    """What a request does once it holds its slot (vllm mode: when the scheduler admits it).

    Records its queue wait, emits the streaming start event ``(0,0)`` and looks the prompt up in the
    KV cache; returns the uncached tokens to prefill. In vllm mode :meth:`scheduled` caches the
    prompt chunk by chunk.
    """

    __slots__ = ("affinity_key", "engine", "eviction", "input_tokens", "lookup", "output_tokens",
                 "prefill_start", "prompt", "queued_at", "record")  # fmt: skip

    def __init__(self, engine: Engine, record: RequestRecord, affinity_key: str | None, prompt: bytes,
                 input_tokens: int, output_tokens: int) -> None:  # fmt: skip
        self.engine = engine
        self.record = record
        self.affinity_key = affinity_key
        self.prompt = prompt
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.queued_at = engine.clock()
        self.prefill_start = self.queued_at
        self.lookup = Lookup(False, 0, input_tokens)
        self.eviction = NO_EVICTION

    def scheduled(self, computed: int) -> None:
        """A prefill chunk was scheduled that ends ``computed`` uncached tokens in: vLLM caches the
        full blocks it covers at once, before they are computed."""
        self.evicted(self.engine.kv.commit(self.lookup, self.input_tokens, self.lookup.reused + computed))

    def evicted(self, eviction: Eviction) -> Eviction:
        """The request's evictions so far, ``eviction`` included."""
        if eviction.entries:
            total = self.eviction
            self.eviction = Eviction(total.entries + eviction.entries, total.tokens + eviction.tokens)
        return self.eviction

    def __call__(self) -> int:
        engine, record = self.engine, self.record
        record.queue_wait_ms = (engine.clock() - self.queued_at) * 1000.0
        record.input_tokens, record.output_tokens = self.input_tokens, self.output_tokens
        if record.stream:
            engine.stats.emit(record.request_id, record.model, 0, 0)
        self.lookup = engine.kv.access(self.affinity_key, self.prompt, self.input_tokens)
        self.prefill_start = engine.clock()
        return self.lookup.uncached


def log_request(engine: Engine, record: RequestRecord) -> None:
    if engine.log is not None:
        engine.log.add(record)


async def _stream(
    engine: Engine,
    request: web.Request,
    kind: Kind,
    body: dict[str, Any],
    ident: str,
    request_id: str,
    model: str,
    headers: dict[str, str],
    record: RequestRecord,
    drop_after: int | None,
    seat: Seat,
) -> web.StreamResponse:
    created = int(engine.wall_clock())
    options = body.get("stream_options") or {}
    include_usage = options.get("include_usage") is True
    fingerprint = engine.backend_id
    encoder: fmt.StreamFormat
    if kind == "chat":
        encoder = fmt.ChatStream(ident, model, fingerprint, created, include_usage)
    elif kind == "completions":
        encoder = fmt.CompletionsStream(ident, model, fingerprint, created, include_usage)
    else:
        encoder = fmt.ResponsesStream(ident, model, created)
    headers["content-type"] = "text/event-stream"
    headers["cache-control"] = "no-cache"
    response = web.StreamResponse(headers=headers)
    inp, n = record.input_tokens, record.output_tokens
    try:
        writer = await response.prepare(request)
        preamble = encoder.preamble()
        if preamble:
            await response.write(preamble)
        else:
            send_headers = getattr(writer, "send_headers", None)  # aiohttp buffers headers until the body
            if send_headers is not None:
                send_headers()
    except ConnectionError:  # the client left before the answer began
        record.status, record.outcome = 499, "client_disconnected"
        return response
    transport = request.transport
    # HTTP/1.0 has no chunked framing: there the body is the bare events, ended by the connection's end.
    chunked = getattr(writer, "chunked", False)
    await _first_token_wait(engine, request_id)
    stats = engine.stats
    stats.emit(request_id, model, inp, 0)
    record.first_token = engine.to_wall(engine.clock())
    token = encoder.token

    def emit(i: int) -> bool:
        if (drop_after is not None and i >= drop_after) or transport is None or transport.is_closing():
            return False
        data = token(i)
        if chunked:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))  # one chunked-encoding write per token
        else:
            transport.write(data)
        if stats.active:
            stats.emit(request_id, model, inp, i + 1)
        return True

    emitted = await _run_decode(engine, seat, request_id, n, emit, record)
    if emitted < n:
        if transport is None or transport.is_closing():
            record.status, record.outcome = 499, "client_disconnected"
        else:
            record.outcome = "dropped"
            abort(request)
        return response
    final = encoder.finish(inp, n)
    stats.emit(request_id, model, inp, n, True)
    record.finish = engine.to_wall(engine.clock())
    try:
        await response.write_eof(final)  # the last event and the end of the body in one write
    except ConnectionError:  # the client left between its last token and the end
        record.status, record.outcome = 499, "client_disconnected"
    else:
        engine.requests_completed += 1
    return response


async def _first_token_wait(engine: Engine, request_id: str) -> None:
    delay = first_token_delay_s(engine.timing, request_id)
    if delay > 0:
        await engine.sleep(delay)
    if engine.control.paused:
        await engine.control.wait_resumed()


async def _run_decode(
    engine: Engine, seat: Seat, request_id: str, n: int, emit: Callable[[int], bool], record: RequestRecord
) -> int:
    """Decode ``n`` tokens on the shared scheduler; returns how many were emitted."""
    decode = Decode(n, request_id, engine.timing.decode_jitter_ms, emit)
    engine.start_decode(seat, decode)
    try:
        return await decode.done
    finally:
        engine.stop_decode(seat, decode)
        record.emitted_tokens = decode.emitted


def _accept(_: int) -> bool:
    return True


def abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


async def _respond(
    engine: Engine,
    request: web.Request,
    kind: Kind,
    ident: str,
    request_id: str,
    model: str,
    headers: dict[str, str],
    record: RequestRecord,
    drop_after: int | None,
    seat: Seat,
) -> web.StreamResponse:
    inp, n = record.input_tokens, record.output_tokens
    await _first_token_wait(engine, request_id)
    record.first_token = engine.to_wall(engine.clock())
    await _run_decode(engine, seat, request_id, n, _accept, record)
    if drop_after is not None:
        record.outcome = "dropped"
        abort(request)
        return web.Response(status=200)
    engine.stats.emit(request_id, model, inp, n, True)
    created = int(engine.wall_clock())
    fp = engine.backend_id
    if kind == "chat":
        payload = fmt.chat_body(ident, model, fp, created, inp, n)
    elif kind == "completions":
        payload = fmt.completions_body(ident, model, fp, created, inp, n)
    else:
        payload = fmt.response_body(ident, model, created, inp, n)
    record.finish = engine.to_wall(engine.clock())
    engine.requests_completed += 1
    return web.Response(body=orjson.dumps(payload), content_type="application/json", headers=headers)
