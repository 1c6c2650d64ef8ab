"""Test-control state (mock-engine spec §7) and fault injection.

Spec endpoints: ``PUT /test-control/models/{model}``, ``GET /test-control``,
``PUT /test-control/discovery-models``. Extensions: ``PUT /test-control/faults`` (fail the next N
requests with a status, optionally marked retryable; add latency; hang before the first byte;
drop the connection after K chunks), ``DELETE /test-control/faults``, ``POST /test-control/pause``
and ``POST /test-control/resume``. Faults apply to the generating endpoints and embeddings.
The model body's extra ``max_engine_concurrency`` field (integer >= 0, ``null`` clears) overrides
the limit the stats stream pings advertise, so tests can move Pylon's engine-reported limit at
runtime (0 = an explicit withdrawal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from stargate.errors import FaultError
from stargate.wire.limits import U32_MAX

from .request_body import read_body

ENDPOINTS = ("chat_completions", "responses", "completions", "embeddings")
CLASSES = ("pylon_generated", "api_gateway")
MAX_COUNTER_KEYS = 4096
MAX_MODELS = 4096


def request_class(request_id: str) -> str:
    if request_id.startswith(("calibration-", "canary-")):
        return "pylon_generated"
    return "api_gateway"


@dataclass(frozen=True, slots=True)
class Failure:
    status: int
    retryable: bool
    retry_after_s: int | None


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What the faults in force do to one request; taken once when it arrives."""

    failure: Failure | None = None
    delay_s: float = 0.0
    drop_after_chunks: int | None = None


NO_FAULT = FaultPlan()


def _int(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FaultError(f"{name} must be an integer in [{low}, {high}]")
    return value


def _ms(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 86_400_000:
        raise FaultError(f"{name} must be a number of milliseconds in [0, 86400000]")
    return float(value)


class Faults:
    def __init__(self) -> None:
        self.fail_next = 0
        self.fail_status = 503
        self.fail_retryable = False
        self.fail_retry_after_s: int | None = None
        self.extra_latency_ms = 0.0
        self.hang_next = 0
        self.hang_ms = 0.0
        self.drop_next = 0
        self.drop_after_chunks = 0
        self.armed = False

    def update(self, body: dict[str, Any]) -> None:
        """Validate the whole body first, then apply it; omitted fields keep their value."""
        known = {
            "fail_next", "fail_status", "fail_retryable", "fail_retry_after_s", "extra_latency_ms",
            "hang_next", "hang_ms", "drop_next", "drop_after_chunks",
        }  # fmt: skip
        unknown = sorted(set(body) - known)
        if unknown:
            raise FaultError(f"unknown fault field {unknown[0]!r}")
        retryable = body.get("fail_retryable")
        if retryable is not None and not isinstance(retryable, bool):
            raise FaultError("fail_retryable must be a boolean")
        values = {
            "fail_next": _int(body, "fail_next", 0, 1 << 31),
            "fail_status": _int(body, "fail_status", 400, 599),
            "fail_retry_after_s": _int(body, "fail_retry_after_s", 0, 86_400),
            "hang_next": _int(body, "hang_next", 0, 1 << 31),
            "drop_next": _int(body, "drop_next", 0, 1 << 31),
            "drop_after_chunks": _int(body, "drop_after_chunks", 0, 1 << 31),
            "extra_latency_ms": _ms(body, "extra_latency_ms"),
            "hang_ms": _ms(body, "hang_ms"),
            "fail_retryable": retryable,
        }
        for name, value in values.items():
            if value is not None:
                setattr(self, name, value)
        self._rearm()

    def _rearm(self) -> None:
        self.armed = bool(self.fail_next or self.extra_latency_ms or self.hang_next or self.drop_next)

    def take(self) -> FaultPlan:
        """The plan for the next request; decrements the ``*_next`` counters it consumes."""
        if not self.armed:
            return NO_FAULT
        failure = None
        if self.fail_next > 0:
            self.fail_next -= 1
            failure = Failure(self.fail_status, self.fail_retryable, self.fail_retry_after_s)
        delay = self.extra_latency_ms / 1000.0
        drop = None
        if failure is None:
            if self.hang_next > 0:
                self.hang_next -= 1
                delay += self.hang_ms / 1000.0
            if self.drop_next > 0:
                self.drop_next -= 1
                drop = self.drop_after_chunks
        self._rearm()
        return FaultPlan(failure, delay, drop)

    def snapshot(self) -> dict[str, Any]:
        return {
            "fail_next": self.fail_next,
            "fail_status": self.fail_status,
            "fail_retryable": self.fail_retryable,
            "fail_retry_after_s": self.fail_retry_after_s,
            "extra_latency_ms": self.extra_latency_ms,
            "hang_next": self.hang_next,
            "hang_ms": self.hang_ms,
            "drop_next": self.drop_next,
            "drop_after_chunks": self.drop_after_chunks,
        }


class TestControl:
    __test__ = False  # not a pytest class

    def __init__(
        self,
        default_model: str,
        on_pause: Callable[[], None] | None = None,
        on_resume: Callable[[], None] | None = None,
    ) -> None:
        self._on_pause = on_pause
        self._on_resume = on_resume
        self.discovered: list[str] = [default_model]
        self.discovery_requests = 0
        self.models: dict[str, dict[str, bool]] = {}
        self.limit_overrides: dict[str, int] = {}
        self.counters: dict[tuple[str, str, str], int] = {}
        self.faults = Faults()
        self._released = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def wait_resumed(self) -> None:
        await self._resumed.wait()

    def count(self, endpoint: str, model: str, klass: str) -> None:
        key = (endpoint, model, klass)
        if key in self.counters or len(self.counters) < MAX_COUNTER_KEYS:
            self.counters[key] = self.counters.get(key, 0) + 1

    def chat_failure(self, model: str) -> bool:
        switches = self.models.get(model)
        return bool(switches and switches["chat_failure"])

    async def bringup_hold(self, model: str, klass: str) -> None:
        """Hold Pylon-generated requests for a blocked model until it is released."""
        if klass != "pylon_generated":
            return
        while (switches := self.models.get(model)) and switches["bringup_blocked"]:
            self._released.clear()
            await self._released.wait()

    def snapshot(self) -> dict[str, Any]:
        def order(item: tuple[tuple[str, str, str], int]) -> tuple[int, str, int]:
            (endpoint, model, klass), _ = item
            return ENDPOINTS.index(endpoint), model, CLASSES.index(klass)

        return {
            "discovered_models": list(self.discovered),
            "model_discovery_requests": self.discovery_requests,
            "models": {name: dict(switches) for name, switches in sorted(self.models.items())},
            "counters": [
                {"endpoint": e, "model": m, "request_class": c, "count": n}
                for (e, m, c), n in sorted(self.counters.items(), key=order)
            ],
            "faults": self.faults.snapshot(),
            "paused": self.paused,
            "max_engine_concurrency_overrides": dict(sorted(self.limit_overrides.items())),
        }

    def set_model(self, model: str, body: dict[str, Any]) -> None:
        for name in ("chat_failure", "bringup_blocked"):
            if name in body and not isinstance(body[name], bool):
                raise FaultError(f"{name} must be a boolean")
        limit = body.get("max_engine_concurrency")
        bad_limit = not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= U32_MAX
        if limit is not None and bad_limit:
            raise FaultError(f"max_engine_concurrency must be an integer in [0, {U32_MAX}] or null")
        if model not in self.models and len(self.models) >= MAX_MODELS:
            raise FaultError("too many models under test control")
        if "max_engine_concurrency" in body:
            if limit is None:
                self.limit_overrides.pop(model, None)
            else:
                self.limit_overrides[model] = limit
        switches = self.models.setdefault(model, {"chat_failure": False, "bringup_blocked": False})
        for name in ("chat_failure", "bringup_blocked"):
            if name in body:
                switches[name] = body[name]
        if not switches["bringup_blocked"]:
            self._released.set()

    def set_discovery(self, models: Any) -> None:
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise FaultError("models must be a list of strings")
        trimmed = [m.strip() for m in models]
        if any(not m for m in trimmed):
            raise FaultError("model IDs must be non-empty")
        self.discovered = sorted(set(trimmed))

    def pause(self) -> None:
        """Stall new requests before their slot and in-flight decodes between tokens."""
        self._resumed.clear()
        if self._on_pause is not None:
            self._on_pause()

    def resume(self) -> None:
        self._resumed.set()
        if self._on_resume is not None:
            self._on_resume()


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await read_body(request))
    except ValueError as exc:
        raise web.HTTPBadRequest(text="request body must be JSON") from exc
    if not isinstance(body, dict):
        raise web.HTTPUnprocessableEntity(text="request body must be a JSON object")
    return body


@contextlib.contextmanager
def _answer_400() -> Iterator[None]:
    """A ``FaultError`` becomes the spec's 400 with its message as plain text."""
    try:
        yield
    except FaultError as exc:
        raise web.HTTPBadRequest(text=exc.message) from exc


def routes(control: TestControl) -> list[web.RouteDef]:
    async def snapshot(_: web.Request) -> web.Response:
        return web.json_response(control.snapshot())

    async def put_model(request: web.Request) -> web.Response:
        with _answer_400():
            control.set_model(request.match_info["model"], await _json_object(request))
        return web.json_response(control.snapshot())

    async def put_discovery(request: web.Request) -> web.Response:
        body = await _json_object(request)
        with _answer_400():
            control.set_discovery(body.get("models"))
        return web.json_response(control.snapshot())

    async def put_faults(request: web.Request) -> web.Response:
        with _answer_400():
            control.faults.update(await _json_object(request))
        return web.json_response(control.snapshot())

    async def clear_faults(_: web.Request) -> web.Response:
        control.faults = Faults()
        return web.json_response(control.snapshot())

    async def pause(_: web.Request) -> web.Response:
        control.pause()
        return web.json_response(control.snapshot())

    async def resume(_: web.Request) -> web.Response:
        control.resume()
        return web.json_response(control.snapshot())

    return [
        web.get("/test-control", snapshot),
        web.put("/test-control/models/{model}", put_model),
        web.put("/test-control/discovery-models", put_discovery),
        web.put("/test-control/faults", put_faults),
        web.delete("/test-control/faults", clear_faults),
        web.post("/test-control/pause", pause),
        web.post("/test-control/resume", resume),
    ]
