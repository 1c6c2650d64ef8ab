"""Non-proxy HTTP endpoints: health, readiness, model discovery and the operator snapshot (§4.1, §4.10)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from stargate.errors import ModelNotFound, RequestError
from stargate.responses import error_response
from stargate.router.headers import via_problem
from stargate.wire.client_faults import detail


@dataclass
class Endpoints:
    """``config`` is the explicit, non-secret field set of ``/debug/state``; nothing else is exposed.

    ``/debug/routing`` is ours (not in the original): the routing targets with each cluster's
    candidate stats and its backends' latest stats, so an operator can see what the balancer sees.

    ``openai`` (plain-client mode) adds what OpenAI clients and load tools expect beside the spec's
    surface: the OpenAI list fields in ``/v1/models`` (``model_ids`` kept), ``/v1/models/{id}`` and
    ``GET /health``. ``created`` of a model is the router's start time (no registration time exists).
    A ``GET /health`` that carries this router's own ``via`` name is its own health probe come back
    (a backend URL that leads here) and fails, so that backend never enters routing.
    """

    list_models: Callable[[str | None, list[str]], list[str]]
    active_model_ids: Callable[[], list[str]]
    config: Callable[[], Mapping[str, object]]
    routing: Callable[[], object]
    draining: bool = False
    openai: bool = False
    via: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def readyz(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        try:
            model_ids = self.list_models(None, request.query.getall("model_ids", []))
        except RequestError as exc:
            return error_response(exc)
        if not self.openai:
            return _json({"model_ids": model_ids})
        data = [self._model(model_id) for model_id in model_ids]
        return _json({"object": "list", "data": data, "model_ids": model_ids})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if not model_id.strip() or model_id not in self.list_models(None, [model_id]):
            message = f"model {detail(repr(model_id))} is not served by any active backend"
            return error_response(ModelNotFound(message))
        return _json(self._model(model_id))

    async def health(self, request: web.Request) -> web.Response:
        if self.via is not None and (problem := via_problem(request.headers, self.via)) is not None:
            return error_response(problem)
        return _json({"status": "ok"})

    def _model(self, model_id: str) -> dict[str, object]:
        return {"id": model_id, "object": "model", "created": self.started_at, "owned_by": "stargate"}

    async def debug_state(self, request: web.Request) -> web.Response:
        return _json(
            {"config": dict(self.config()), "active_model_ids": sorted(set(self.active_model_ids()))}
        )

    async def debug_routing(self, request: web.Request) -> web.Response:
        return _json({"targets": self.routing()})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/debug/state", self.debug_state)
        app.router.add_get("/debug/routing", self.debug_routing)
        if self.openai:
            app.router.add_get("/v1/models/{model_id:.+}", self.model)
            app.router.add_get("/health", self.health)


def _json(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")
