from __future__ import annotations

import asyncio
import itertools

import aiohttp
import orjson
import pytest
from aiohttp import web

from stargate.pylon.calibration import CalibrationError, Calibrator, Step, is_prompt_too_long, steps
from stargate.pylon.ids import RequestIds
from stargate.wire.clock import SystemClock

from .helpers import make_rig


def test_b33_default_ramp() -> None:
    assert list(itertools.islice(steps(5, 4096, 4), 6)) == [
        Step(256, 5, 1),
        Step(512, 10, 2),
        Step(1024, 20, 3),
        Step(2048, 40, 4),
        Step(4096, 80, 4),
        Step(4096, 160, 4),
    ]


def test_b35_prompt_too_long_detection() -> None:
    assert is_prompt_too_long(400, b'{"error":{"message":"Prompt too long for model"}}')
    assert is_prompt_too_long(413, b'{"error":{"message":"exceeds maximum context"}}')
    assert not is_prompt_too_long(500, b'{"error":{"message":"prompt too long"}}')
    assert not is_prompt_too_long(400, b"nope")


def test_b40_generated_ids() -> None:
    ids = RequestIds()
    a, b = ids.new("canary", 0), ids.new("calibration", 0)
    assert a == f"canary-{ids.uuid}-g0-1" and b == f"calibration-{ids.uuid}-g0-2"
    assert ids.parse(b) is not None and ids.parse(b).kind == "calibration"  # type: ignore[union-attr]
    assert RequestIds().parse(a) is None


class Upstream:
    """Loopback engine for calibration: rejects prompts above ``max_prompt`` as too long."""

    def __init__(self, max_prompt: int | None = None, delay_s: float = 0.012) -> None:
        self.max_prompt = max_prompt
        self.delay_s = delay_s
        self.sizes: list[int] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _chat(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        size = len(body["messages"][0]["content"])
        self.sizes.append(size)
        if self.max_prompt is not None and size > self.max_prompt:
            return web.json_response({"error": {"message": "Prompt too long for this model"}}, status=400)
        await asyncio.sleep(self.delay_s)  # above the 10 ms floor, so each answer is an input sample
        return web.json_response({"choices": [], "usage": {"completion_tokens": 1}})

    async def __aenter__(self) -> Upstream:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


async def calibrate(upstream: Upstream, *, prompt_units: int, step_timeout_s: float) -> float:
    rig = make_rig()
    async with aiohttp.ClientSession() as session:
        calibrator = Calibrator(
            session=session, base_url=upstream.url, hub=rig.hub, ids=RequestIds(), clock=SystemClock(),
            requests=1, prompt_units=prompt_units, max_concurrency=4, step_timeout_s=step_timeout_s,
        )  # fmt: skip
        return await calibrator.run(rig.gen)


async def test_b35_prompt_too_long_clamps_later_steps_to_last_completed_size() -> None:
    async with Upstream(max_prompt=700) as upstream:
        tps = await calibrate(upstream, prompt_units=1536, step_timeout_s=0.3)
    assert tps > 0
    rejected = upstream.sizes.index(1024)
    assert set(upstream.sizes[:rejected]) == {256, 512}
    later = [size for size in upstream.sizes[rejected:] if size != 1024]
    assert later and set(later) == {512}  # never 1536 again, never above the rejection


async def test_b36_prompt_too_long_at_the_first_size_fails() -> None:
    async with Upstream(max_prompt=200) as upstream:
        with pytest.raises(CalibrationError, match="rejected as too long"):
            await calibrate(upstream, prompt_units=4096, step_timeout_s=5)
    assert upstream.sizes == [256]


async def test_b37_step_timeout_before_five_samples_is_insufficient_data() -> None:
    async with Upstream(delay_s=0.5) as upstream:
        with pytest.raises(CalibrationError, match="insufficient calibration data"):
            await calibrate(upstream, prompt_units=4096, step_timeout_s=0.1)
    assert upstream.sizes == [256]
