"""Local calibration ramp (spec pylon.md §5.1).

Step k sends ``requests·2^k`` non-streaming one-token chats of ``min(256·2^k, max_prompt)``
characters with at most ``min(1+k, max_concurrency)`` in flight. Only a step timeout ends the
ramp: it succeeds iff the model's published ``last_mean_input_tps`` is then finite and > 0.
Each request is observed like proxied traffic, so its input-TPS sample comes from the fallback
rule ``input_tokens / time_to_first_output`` (first output = whole body received).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import orjson

from stargate.balancer.types import valid_tps
from stargate.errors import CalibrationError
from stargate.pylon.ids import CALIBRATION, RequestIds
from stargate.pylon.models import Generation
from stargate.pylon.observer import RequestObserver
from stargate.pylon.stats.hub import StatsHub
from stargate.pylon.stats.observation import Endpoint
from stargate.wire import headers as h
from stargate.wire.clock import Clock

MIN_PROMPT = 256
_TOO_LONG = ("prompt too long", "context length", "maximum context")


def engine_chat(
    model_id: str, request_id: str, content: str, *, max_tokens: int, input_tokens: int, stream: bool = False
) -> tuple[bytes, dict[str, str]]:
    """Body and headers of Pylon's own chat to the engine (calibration and canaries).

    Both use the original's fixed sampling (seed 33, temperature 0.7, top_p 1.0) so engines see
    the same request shape from either; a streamed one asks for its usage in the last event.
    """
    body: dict[str, object] = {
        "model": model_id,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "seed": 33,
        "temperature": 0.7,
        "top_p": 1.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {
        "content-type": "application/json",
        h.REQUEST_ID: request_id,
        h.MODEL: model_id,
        h.INPUT_TOKENS: str(input_tokens),
    }
    return orjson.dumps(body), headers


class PromptTooLong(Exception):
    """Private signal: the engine refused a prompt as too long, so the ramp caps its prompt size."""


@dataclass(frozen=True, slots=True)
class Step:
    prompt_units: int
    requests: int
    concurrency: int


def steps(
    requests: int, prompt_units: int, max_concurrency: int, max_prompt: int | None = None
) -> Iterator[Step]:
    """The unbounded ramp; ``max_prompt`` clamps prompt sizes after a prompt-too-long rejection."""
    ceiling = max(prompt_units, MIN_PROMPT) if max_prompt is None else max_prompt
    k = 0
    while True:
        yield Step(min(MIN_PROMPT * 2**k, ceiling), requests * 2**k, min(1 + k, max(max_concurrency, 1)))
        k += 1


def is_prompt_too_long(status: int, body: bytes) -> bool:
    if not 400 <= status < 500:
        return False
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return isinstance(message, str) and any(p in message.lower() for p in _TOO_LONG)


class Calibrator:
    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        base_url: str,
        hub: StatsHub,
        ids: RequestIds,
        clock: Clock,
        requests: int,
        prompt_units: int,
        max_concurrency: int,
        step_timeout_s: float,
    ) -> None:
        self._session = session
        self._url = base_url + "/v1/chat/completions"
        self._hub = hub
        self._ids = ids
        self._clock = clock
        self._requests = requests
        self._prompt_units = max(prompt_units, MIN_PROMPT)
        self._max_concurrency = max_concurrency
        self._step_timeout_s = step_timeout_s

    async def _one(self, gen: Generation, units: int) -> None:
        request_id = self._ids.new(CALIBRATION, gen.seq)
        body, headers = engine_chat(gen.model_id, request_id, "1" * units, max_tokens=1, input_tokens=units)
        observer = RequestObserver(
            request_id=request_id,
            generation=gen,
            endpoint=Endpoint.CHAT,
            input_tokens=units,
            clock=self._clock,
            sink=self._hub.on_observation,
            calibration=True,
        )
        try:
            async with self._session.post(self._url, data=body, headers=headers) as resp:
                observer.headers(resp.status)
                payload = await resp.read()
                if is_prompt_too_long(resp.status, payload):
                    raise PromptTooLong
                if not 200 <= resp.status < 300:
                    raise CalibrationError(f"calibration request answered HTTP {resp.status}")
                observer.output(1)
                observer.finish()
        except aiohttp.ClientError as exc:
            raise CalibrationError(f"calibration request failed: {exc}") from exc
        finally:
            observer.finish(failed=True)

    async def _step(self, gen: Generation, step: Step) -> None:
        gate = asyncio.Semaphore(min(step.concurrency, step.requests))

        async def guarded() -> None:
            async with gate:
                await self._one(gen, step.prompt_units)

        async with asyncio.TaskGroup() as group:
            for _ in range(step.requests):
                group.create_task(guarded())

    async def run(self, gen: Generation) -> float:
        """Ramp until a step times out; returns the published input TPS."""
        completed: list[int] = []
        max_prompt: int | None = None
        ramp = steps(self._requests, self._prompt_units, self._max_concurrency)
        while True:
            step = next(ramp)
            if max_prompt is not None:
                step = Step(min(step.prompt_units, max_prompt), step.requests, step.concurrency)
            try:
                await asyncio.wait_for(self._step(gen, step), self._step_timeout_s)
            except TimeoutError:
                tps = self._hub.input_tps(gen)
                if not valid_tps(tps):
                    raise CalibrationError("insufficient calibration data") from None
                return tps
            except ExceptionGroup as group:
                # split, not subgroup(callable): a callable is also applied to the group itself.
                too_long, other = group.split(PromptTooLong)
                if too_long is None or other is not None:
                    first = (other or group).exceptions[0]
                    raise (
                        first if isinstance(first, CalibrationError) else CalibrationError(str(first))
                    ) from group
                smaller = [u for u in completed if u < step.prompt_units]
                if not smaller:
                    raise CalibrationError(
                        f"prompt of {step.prompt_units} characters rejected as too long"
                    ) from None
                max_prompt = max(smaller)
                continue
            completed.append(step.prompt_units)
