"""Worker endpoints that third-party routers probe, so they can front the mock engine offline.

sglang-router registers a worker with ``GET /health``, ``/server_info`` (or ``/get_server_info``) and
``/model_info`` (or ``/get_model_info``), polls ``GET /get_load`` for ``power_of_two``, and may ask for
``POST /tokenize``; vllm-router checks ``/health`` and some policies render chats with
``POST /v1/chat/completions/render``. The answers are the SGLang/vLLM shapes reduced to the fields
those routers read. ``model_path``/``tokenizer_path`` report a local tokenizer directory (the
``STARGATE_MOCK_TOKENIZER_PATH`` environment variable, written by the bench) so a router that loads a
tokenizer from them never reaches for a model hub; without one they report the model name.

``register`` adds a route only where the app has none for that method and path, so the engine's own
handlers (e.g. its ``/health``) win. ``quiet_prior_knowledge_probes`` drops aiohttp's log lines for
the HTTP/2 prior-knowledge preface (``PRI * HTTP/2.0``) that sglang-router sends first: aiohttp
answers it 400 and closes, the router falls back to HTTP/1.1, and the line is noise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

TOKENIZER_ENV = "STARGATE_MOCK_TOKENIZER_PATH"
MAX_TOKENIZE_BODY = 8 << 20
_SPECIAL = ("<|im_start|>", "<|im_end|>")

LoadFn = Callable[[], tuple[int, int]]  # (running requests, waiting requests)


@dataclass(frozen=True)
class PeerInfo:
    model: str
    engine_id: str
    max_running_requests: int
    max_total_tokens: int
    load: LoadFn
    tokenizer_path: str | None = None

    @property
    def model_path(self) -> str:
        return self.tokenizer_path or os.environ.get(TOKENIZER_ENV) or self.model


def render_chat(messages: Any) -> str:
    """ChatML rendering, the same template the bench's tokenizer directory carries."""
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError("each message must be an object")
        content = message.get("content", "")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{_SPECIAL[0]}{message.get('role', 'user')}\n{content}{_SPECIAL[1]}\n")
    parts.append(f"{_SPECIAL[0]}assistant\n")
    return "".join(parts)


def token_ids(text: str) -> list[int]:
    """One id per UTF-8 byte, matching the byte-level tokenizer the bench writes."""
    return list(text.encode())


def server_info(info: PeerInfo) -> dict[str, Any]:
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "served_model_name": info.model,
        "is_generation": True,
        "dp_size": 1,
        "tp_size": 1,
        "max_running_requests": info.max_running_requests,
        "max_total_num_tokens": info.max_total_tokens,
        "context_length": info.max_total_tokens,
        "version": "mock",
        "internal_states": [{"last_gen_throughput": 0.0}],
        "engine_id": info.engine_id,
    }


def model_info(info: PeerInfo) -> dict[str, Any]:
    return {
        "model_path": info.model_path,
        "tokenizer_path": info.model_path,
        "served_model_name": info.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "mock",
        "architectures": ["MockForCausalLM"],
    }


def load_info(info: PeerInfo) -> list[dict[str, Any]]:
    running, waiting = info.load()
    return [
        {
            "dp_rank": 0,
            "num_reqs": running + waiting,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_tokens": 0,
            "load": running + waiting,
        }
    ]


async def _json(request: web.Request) -> dict[str, Any]:
    size = request.content_length or 0
    if size > MAX_TOKENIZE_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_TOKENIZE_BODY, actual_size=size)
    try:
        body = await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(
            text='{"error": "request body must be JSON"}', content_type="application/json"
        ) from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text='{"error": "request body must be a JSON object"}', content_type="application/json"
        )
    return body


def _bad(message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}}, status=400)


def routes(info: PeerInfo) -> list[web.RouteDef]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def get_server_info(_: web.Request) -> web.Response:
        return web.json_response(server_info(info))

    async def get_model_info(_: web.Request) -> web.Response:
        return web.json_response(model_info(info))

    async def get_load(_: web.Request) -> web.Response:
        return web.json_response(load_info(info))

    async def tokenize(request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            text = render_chat(body["messages"]) if "messages" in body else body.get("prompt")
        except ValueError as exc:
            return _bad(str(exc))
        if not isinstance(text, str):
            return _bad("'prompt' (a string) or 'messages' is required")
        ids = token_ids(text)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": info.max_total_tokens})

    async def render(request: web.Request) -> web.Response:
        body = await _json(request)
        try:
            text = render_chat(body.get("messages"))
        except ValueError as exc:
            return _bad(str(exc))
        return web.json_response(
            {"prompt": text, "prompt_token_ids": token_ids(text), "model": body.get("model", info.model)}
        )

    return [
        web.get("/health", health),
        web.get("/health_generate", health),
        web.get("/server_info", get_server_info),
        web.get("/get_server_info", get_server_info),
        web.get("/model_info", get_model_info),
        web.get("/get_model_info", get_model_info),
        web.get("/get_load", get_load),
        web.post("/tokenize", tokenize),
        web.post("/v1/chat/completions/render", render),
    ]


def register(app: web.Application, info: PeerInfo) -> None:
    """Add the peer routes that the app does not already serve (same method and path)."""
    taken = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None
    }
    wanted = [r for r in routes(info) if isinstance(r, web.RouteDef) and (r.method, r.path) not in taken]
    app.router.add_routes(wanted)


class _PriorKnowledgeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        detail = f"{text} {exc}" if exc is not None else text
        return "PRI/Upgrade" not in detail and "PRI * HTTP/2.0" not in detail


_FILTER = _PriorKnowledgeFilter()


def quiet_prior_knowledge_probes() -> None:
    """Idempotent: drop aiohttp's error lines for the HTTP/2 preface probe, keep every other line."""
    for name in ("aiohttp.server", "aiohttp.access", "aiohttp.web"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
