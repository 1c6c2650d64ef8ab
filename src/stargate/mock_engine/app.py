"""The aiohttp application of the mock engine: routes, identity header, lifecycle."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from stargate.wire import headers as h
from stargate.wire.address import join_host_port
from stargate.wire.client_faults import ClientFaults
from stargate.wire.http_server import ClientTimeouts, GuardedAppRunner, expectation_problem, send_continue
from stargate.wire.listen import listen

from . import control as control_module
from . import metrics
from . import openai_format as fmt
from . import tokens as tok
from .control import request_class
from .engine import Engine
from .generate import (
    abort,
    error_response,
    failure_response,
    generate,
    log_request,
    new_id,
    queue_full_response,
    read_json,
    resolve_model,
)
from .request_log import RequestRecord
from .steps import QueueFull

ENGINE_KEY = web.AppKey("engine", Engine)
CLIENT_TIMEOUTS = ClientTimeouts(head_s=60.0, body_s=60.0, send_s=60.0)
"""How long a client may stall a request head, a body or an unread answer: a simulator has no
reason to hold a connection longer, and a benchmark client reads as it goes."""

log = logging.getLogger("stargate.mock_engine")


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


async def embeddings(engine: Engine, request: web.Request) -> web.Response:
    """Answered at once, with the faults, the pause and the logs the generating endpoints have
    (an armed hang or drop was used up by an embeddings request without being applied)."""
    arrival = engine.clock()
    body = await read_json(request)
    if "input" not in body:
        raise web.HTTPUnprocessableEntity(text="field 'input' is required")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise web.HTTPUnprocessableEntity(text="field 'encoding_format' must be 'float' or 'base64'")
    model = resolve_model(engine, body)
    header_id = request.headers.get(h.REQUEST_ID, "")
    request_id = header_id or new_id("embd-mock-")
    if engine.arrivals is not None:
        engine.arrivals.add(request_id, engine.to_wall(arrival))
    klass = request_class(header_id)
    engine.control.count("embeddings", model, klass)
    await engine.control.bringup_hold(model, klass)
    plan = engine.control.faults.take()
    if plan.failure is not None:
        return failure_response(plan.failure)
    if engine.control.paused:
        await engine.control.wait_resumed()
    record = RequestRecord(request_id, "embeddings", model, engine.to_wall(arrival))
    queued_at = engine.clock()
    try:
        await engine.slots.acquire()
        record.queue_wait_ms = (engine.clock() - queued_at) * 1000.0
    except QueueFull:
        record.status, record.outcome = 429, "queue_full"
        log_request(engine, record)
        return queue_full_response(engine)
    try:
        if plan.delay_s > 0:
            await engine.sleep(plan.delay_s)
        if plan.drop_after_chunks is not None:  # no answer at all, as for a JSON generation
            record.outcome = "dropped"
            abort(request)
            return web.Response(status=200)
        value = body["input"]
        items = tok.embeddings_item_count(value)
        header = tok.parse_token_header(request.headers.get(h.INPUT_TOKENS))
        record.input_tokens = max(1, header) if header is not None else tok.embeddings_input_estimate(value)
        engine.stats.emit(request_id, model, record.input_tokens, None, True)
        return _json(fmt.embeddings_body(model, items, record.input_tokens, encoding == "base64"))
    except asyncio.CancelledError:
        record.status, record.outcome = 499, "client_disconnected"
        raise
    finally:
        engine.slots.release()
        record.finish = engine.to_wall(engine.clock())
        log_request(engine, record)


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client errors of the OpenAI API (``/v1/``) as JSON error bodies, as an OpenAI server answers
    them (aiohttp's are text), with their headers (``Allow`` of a 405). Test control keeps the
    original's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not request.path.startswith("/v1/"):
            raise
        dropped = ("content-type", "content-length", "connection")
        kept = {k: v for k, v in exc.headers.items() if k.lower() not in dropped}
        response = error_response(exc.status, exc.text or exc.reason, kept)
        if exc.headers.get("connection", "").lower() == "close":
            response.force_close()
        return response


async def _expect(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: a body declared over the limit gets its 413 instead of a 100."""
    problem = expectation_problem(request)
    if problem is not None:
        return error_response(problem.status, problem.message)
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        return error_response(413, f"request body of {request.content_length} bytes exceeds {limit}")
    await send_continue(request)
    return None


def build_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=engine.config.max_body_bytes, middlewares=[_json_errors])
    app[ENGINE_KEY] = engine

    async def add_identity(_: web.Request, response: web.StreamResponse) -> None:
        response.headers[h.MOCK_BACKEND_ID] = engine.backend_id

    app.on_response_prepare.append(add_identity)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await generate(engine, request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(engine, request, "completions")

    async def responses(request: web.Request) -> web.StreamResponse:
        return await generate(engine, request, "responses")

    async def embed(request: web.Request) -> web.Response:
        return await embeddings(engine, request)

    async def models(_: web.Request) -> web.Response:
        engine.control.discovery_requests += 1
        data = [{"id": model, "object": "model", "owned_by": "mock"} for model in engine.control.discovered]
        return _json({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        if engine.config.health_delay_ms > 0:
            await engine.sleep(engine.config.health_delay_ms / 1000.0)
        return web.Response(text="ok")

    async def ready(_: web.Request) -> web.Response:
        return _json({"status": "ready", "object": "health.response", "message": "ready"})

    async def kv_stats(_: web.Request) -> web.Response:
        return _json(engine.kv.stats(engine.config.model))

    async def metrics_view(_: web.Request) -> web.Response:
        return web.Response(text=metrics.render(engine), headers={"content-type": metrics.CONTENT_TYPE})

    app.add_routes(
        [
            web.post("/v1/chat/completions", chat, expect_handler=_expect),
            web.post("/v1/completions", completions, expect_handler=_expect),
            web.post("/v1/responses", responses, expect_handler=_expect),
            web.post("/v1/embeddings", embed, expect_handler=_expect),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/v1/health/ready", ready),
            web.get("/pylon/v1/stats/stream", engine.stats.handle),
            web.get("/kv-cache/stats", kv_stats),
            web.get("/metrics", metrics_view),
            *control_module.routes(engine.control),
        ]
    )

    async def lifecycle(_: web.Application) -> Any:
        if engine.log is not None:
            await engine.log.start()
        if engine.arrivals is not None:
            engine.arrivals.start()
        yield
        if engine.arrivals is not None:
            engine.arrivals.stop()
        if engine.log is not None:
            await engine.log.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


async def start_server(engine: Engine, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Start serving; returns the runner and the bound base URL (``port`` 0 picks one). Malformed
    requests get a JSON 400 and a rate-limited warning, as at the router and Pylon."""
    runner = GuardedAppRunner(
        build_app(engine),
        faults=ClientFaults(log),
        timeouts=CLIENT_TIMEOUTS,
        auto_decompress=False,  # bodies are decoded by read_body, as Pylon decodes them
        access_log=None,
        shutdown_timeout=1.0,
    )
    await listen(runner, host, port)
    bound = runner.addresses[0]
    if not engine.backend_id:
        engine.backend_id = f"{engine.config.model}/{bound[1]}"
        if engine.log is not None:
            engine.log.backend_id = engine.backend_id
        if engine.arrivals is not None:
            engine.arrivals.backend_id = engine.backend_id
    return runner, f"http://{join_host_port(bound[0], bound[1])}"


__all__ = ["ENGINE_KEY", "build_app", "error_response", "start_server"]
