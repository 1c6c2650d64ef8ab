from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from stargate.mock_engine import peer_compat
from stargate.mock_engine.peer_compat import PeerInfo, register, render_chat


def make_info(tokenizer: str | None = "/tok") -> PeerInfo:
    return PeerInfo("m", "engine-0", 8, 4096, lambda: (3, 2), tokenizer)


async def own_health(_: web.Request) -> web.Response:
    return web.Response(text="engine's own")


@pytest.fixture
async def client() -> TestClient[web.Request, web.Application]:
    app = web.Application()
    app.router.add_get("/health", own_health)
    register(app, make_info())
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_probe_endpoints_answer_the_shapes_routers_read(
    client: TestClient[web.Request, web.Application],
) -> None:
    for path in ("/server_info", "/get_server_info"):
        body = await (await client.get(path)).json()
        assert body["model_path"] == body["tokenizer_path"] == "/tok"
        assert body["dp_size"] == 1 and body["max_running_requests"] == 8
    for path in ("/model_info", "/get_model_info"):
        body = await (await client.get(path)).json()
        assert body["model_path"] == "/tok" and body["is_generation"] is True
    load = await (await client.get("/get_load")).json()
    assert load[0]["num_reqs"] == 5 and load[0]["num_waiting_reqs"] == 2


async def test_register_keeps_the_apps_own_routes(client: TestClient[web.Request, web.Application]) -> None:
    assert await (await client.get("/health")).text() == "engine's own"
    assert (await client.get("/health_generate")).status == 200


async def test_tokenize_and_render(client: TestClient[web.Request, web.Application]) -> None:
    body = await (await client.post("/tokenize", json={"prompt": "ab"})).json()
    assert body == {"tokens": [97, 98], "count": 2, "max_model_len": 4096}
    messages = [{"role": "user", "content": "hi"}]
    chat = await (await client.post("/tokenize", json={"messages": messages})).json()
    assert chat["count"] == len(render_chat(messages).encode())
    rendered = await (await client.post("/v1/chat/completions/render", json={"messages": messages})).json()
    assert rendered["prompt"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered["prompt_token_ids"] == list(rendered["prompt"].encode())


async def test_bad_bodies_are_400(client: TestClient[web.Request, web.Application]) -> None:
    assert (await client.post("/tokenize", data=b"{nope")).status == 400
    assert (await client.post("/tokenize", json=[1])).status == 400
    assert (await client.post("/tokenize", json={"prompt": 5})).status == 400
    assert (await client.post("/v1/chat/completions/render", json={"messages": "x"})).status == 400


def test_model_path_falls_back_to_env_then_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(peer_compat.TOKENIZER_ENV, raising=False)
    assert make_info(None).model_path == "m"
    monkeypatch.setenv(peer_compat.TOKENIZER_ENV, "/from-env")
    assert make_info(None).model_path == "/from-env"
    assert make_info("/explicit").model_path == "/explicit"


def test_prior_knowledge_probe_lines_are_dropped_and_others_kept(caplog: pytest.LogCaptureFixture) -> None:
    peer_compat.quiet_prior_knowledge_probes()
    peer_compat.quiet_prior_knowledge_probes()
    logger = logging.getLogger("aiohttp.server")
    assert logger.filters.count(peer_compat._FILTER) == 1
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        logger.error(
            "Error handling request", exc_info=(ValueError, ValueError("Pause on PRI/Upgrade"), None)
        )
        logger.error("something else broke")
    assert [r.getMessage() for r in caplog.records] == ["something else broke"]
