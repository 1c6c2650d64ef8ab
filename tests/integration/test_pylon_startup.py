from __future__ import annotations

import asyncio
import io
import socket
import sys

import pytest
from support.pylon_fakes import FakeEngine, FakeStargate
from support.waiting import until

from stargate.errors import StargateError
from stargate.pylon.app import PylonApp
from stargate.pylon.config import parse_settings


def make_app(engine: FakeEngine, stargate: FakeStargate | str, *extra: str) -> PylonApp:
    address = stargate if isinstance(stargate, str) else stargate.address
    settings = parse_settings(
        [
            "--upstream-http-base-url",
            engine.url,
            "--stargate-address",
            address,
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
            "--min-update-interval-ms",
            "50",
            "--upstream-health-wait-ms",
            "0",
            *extra,
        ]
    )
    return PylonApp(settings, out=io.StringIO())


async def test_b108_b109_b78_registration_stream(
    engine: FakeEngine, stargate: FakeStargate, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    token = tmp_path / "token"
    token.write_text(" secret\n")
    app = make_app(
        engine,
        stargate,
        "--model-name",
        "llama",
        "--max-engine-concurrency",
        "25",
        "--auth-token-file",
        str(token),
        "--inference-server-id",
        "p1",
        "--cluster-id",
        "c1",
    )
    try:
        await app.start()
        await stargate.wait_messages(3)
        assert stargate.register_calls == 1 and stargate.watch_calls == 1
        md = stargate.metadata[0]
        assert md["x-stargate-registration-heartbeat-ms"] == "50" and md["authorization"] == "Bearer secret"
        first = stargate.messages[0]
        assert (first.inference_server_id, first.cluster_id, first.reverse_tunnel) == ("p1", "c1", False)
        assert first.inference_server_url == app.http_url and first.inference_server_url.startswith("http://")
        assert first.models["llama"].stats.max_engine_concurrency == 25
        assert first.models["llama"].status == 1
        assert stargate.messages[2].models["llama"].stats == first.models["llama"].stats
        out = app._out.getvalue()  # type: ignore[union-attr]
        assert f"pylon ready http={app.http_url.removeprefix('http://')}" in out
    finally:
        await app.close()


async def test_b20_initial_tps_two_models(engine: FakeEngine, stargate: FakeStargate) -> None:
    app = make_app(engine, stargate, "--model-name", "a", "--model-name", "b", "--initial-input-tps", "123.5")
    try:
        await app.start()
        await stargate.wait_messages(1)
        msg = stargate.messages[0]
        assert {m: msg.models[m].stats.last_mean_input_tps for m in msg.models} == {"a": 123.5, "b": 123.5}
        assert not any(h.get("x-request-id", "").startswith("calibration-") for _, _, h, _ in engine.requests)
    finally:
        await app.close()


async def test_b21_no_tps_source(engine: FakeEngine, stargate: FakeStargate) -> None:
    app = make_app(engine, stargate, "--model-name", "llama")
    try:
        await app.start()
        await stargate.wait_messages(1)
        assert stargate.messages[0].models["llama"].stats.last_mean_input_tps == 0.0
        assert engine.hits("/v1/chat/completions") == 0
    finally:
        await app.close()


async def test_b19_discovery_empty_models(engine: FakeEngine, stargate: FakeStargate) -> None:
    engine.models = []
    app = make_app(engine, stargate)
    try:
        await app.start()
        await stargate.wait_messages(1)
        assert len(stargate.messages[0].models) == 0
    finally:
        await app.close()


async def test_b29_discovery_dedups(engine: FakeEngine, stargate: FakeStargate) -> None:
    engine.models = ["model-b", "model-a", "model-b"]
    app = make_app(engine, stargate)
    try:
        await app.start()
        assert app.registry.model_ids() == ["model-a", "model-b"]
    finally:
        await app.close()


async def test_b28_unhealthy_upstream_fails_once(engine: FakeEngine, stargate: FakeStargate) -> None:
    engine.health_status = {"/health": 503, "/v1/health/ready": 503}
    app = make_app(engine, stargate, "--model-name", "llama")
    try:
        failed = r"upstream health check failed during pylon startup.*last: HTTP 503"
        with pytest.raises(StargateError, match=failed):
            await app.start()
        assert engine.hits("/health") == 1 and stargate.watch_calls == 0
    finally:
        await app.close()


async def test_b27_disable_bringup_no_probe(engine: FakeEngine, stargate: FakeStargate) -> None:
    app = make_app(engine, stargate, "--model-name", "llama", "--disable-bringup")
    try:
        await app.start()
        assert engine.hits("/health") == 0 and engine.hits("/v1/health/ready") == 0
    finally:
        await app.close()


async def test_b25_resolved_health_path_first(engine: FakeEngine, stargate: FakeStargate) -> None:
    engine.health_status = {"/health": 404, "/v1/health/ready": 200}
    app = make_app(engine, stargate, "--model-name", "llama")
    try:
        await app.start()
        assert (engine.hits("/health"), engine.hits("/v1/health/ready")) == (1, 2)
    finally:
        await app.close()


async def test_b18_unreachable_upstream_discovery(stargate: FakeStargate) -> None:
    dead = FakeEngine(url="http://127.0.0.1:9")
    app = make_app(dead, stargate, "--disable-bringup")
    try:
        with pytest.raises(StargateError, match="initial model discovery failed"):
            await app.start()
        assert stargate.watch_calls == 0
    finally:
        await app.close()


async def test_b17_calibration_failure_aborts_startup(engine: FakeEngine, stargate: FakeStargate) -> None:
    engine.calibration_status = 500
    app = make_app(engine, stargate, "--model-name", "llama", "--do-calibration")
    try:
        with pytest.raises(StargateError, match="pylon initial model initialization failed"):
            await app.start()
        assert stargate.watch_calls == 0 and stargate.register_calls == 0
    finally:
        await app.close()


async def test_b16_b34_calibration_then_single_registration(
    engine: FakeEngine, stargate: FakeStargate
) -> None:
    app = make_app(
        engine,
        stargate,
        "--model-name",
        "a",
        "--model-name",
        "b",
        "--do-calibration",
        "--bringup-calibration-timeout-ms",
        "300",
        "--calibration-requests",
        "5",
    )
    try:
        await app.start()
        await stargate.wait_messages(1)
        assert stargate.watch_calls == 1 and stargate.register_calls == 1
        msg = stargate.messages[0]
        assert all(msg.models[m].stats.last_mean_input_tps > 0 for m in ("a", "b"))
        calib = [
            (h, b) for _, _, h, b in engine.requests if h.get("x-request-id", "").startswith("calibration-")
        ]
        first_b = next(i for i, (h, _) in enumerate(calib) if h["x-model"] == "b")
        assert all(h["x-model"] == "a" for h, _ in calib[:first_b])
        h, b = calib[0]
        assert (
            h["x-input-tokens"] == "256" and b"1" * 256 in b and b'"max_tokens":1' in b and b'"seed":33' in b
        )
    finally:
        await app.close()


async def test_b32_retired_model_gets_new_generation(engine: FakeEngine, stargate: FakeStargate) -> None:
    app = make_app(engine, stargate, "--disable-bringup")
    try:
        await app.start()
        first = app.registry.current("llama")
        assert app._lifecycle is not None
        await app._lifecycle.reconcile([])
        assert "llama" not in app.registration_message().models
        await app._lifecycle.reconcile(["llama"])
        await until("llama admitted again", lambda: app.registry.admitted("llama") is not None)
        second = app.registry.admitted("llama")
        assert first is not None and second is not None and second.seq > first.seq
    finally:
        await app.close()


async def test_b30_blank_discovered_id_rejects_the_whole_poll(
    engine: FakeEngine, stargate: FakeStargate
) -> None:
    engine.models = ["model-a", "  "]
    app = make_app(engine, stargate)
    try:
        with pytest.raises(StargateError, match="blank or missing id"):
            await app.start()
        assert stargate.register_calls == 0 and app.registry.model_ids() == []
    finally:
        await app.close()


async def test_a_discovered_id_no_request_can_name_is_left_out_with_a_warning(
    engine: FakeEngine, stargate: FakeStargate, caplog: pytest.LogCaptureFixture
) -> None:
    """Stargate refuses a registration listing it: the engine's other models are served."""
    engine.models = ["model-a", "mod\u00e8le"]
    app = make_app(engine, stargate)
    try:
        await app.start()
        assert app.registry.model_ids() == ["model-a"]
        assert "'mod\u00e8le' left out: model id must be visible ASCII" in caplog.text
    finally:
        await app.close()


def discovery_errors(app: PylonApp) -> float:
    line = 'pylon_model_discovery_polls_total{outcome="error",provider="dynamo"} '
    for row in app.metrics.render().decode().splitlines():
        if row.startswith(line):
            return float(row.removeprefix(line))
    return 0.0


async def test_b31_failed_polls_keep_last_known_good_models(
    engine: FakeEngine, stargate: FakeStargate
) -> None:
    """503, a body without ``data`` and a blank id (§14 item 30) each fail the poll; models stay."""
    app = make_app(engine, stargate, "--model-discovery-poll-interval-ms", "20")
    try:
        await app.start()
        admitted = app.registry.admitted("llama")
        assert admitted is not None and discovery_errors(app) == 0
        failures: list[tuple[int, bytes | None, list[str]]] = [
            (503, None, ["llama"]),
            (200, b'{"object":"list"}', ["llama"]),
            (200, None, ["llama", " "]),
        ]
        for expected, (status, body, models) in enumerate(failures, start=1):
            engine.models_status, engine.models_body, engine.models = status, body, models
            await until(f"failed poll {expected}", lambda: discovery_errors(app) >= expected)  # noqa: B023
            assert app.registry.admitted("llama") == admitted
            assert set(app.registration_message().models) == {"llama"}
        engine.models_status, engine.models_body, engine.models = 200, None, ["other"]
        # a good poll still reconciles
        await until("llama retired", lambda: app.registry.current("llama") is None)
    finally:
        await app.close()


async def test_a_listen_address_in_use_names_its_flag_and_exits_2() -> None:
    """As the router does: the operator's fix is that flag, so it is a usage error, not a crash."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        code = "import sys; from stargate.pylon.cli import main; sys.exit(main(sys.argv[1:]))"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, "--upstream-http-base-url", "http://127.0.0.1:9", "--model-name", "m",
            "--http-listen-addr", f"127.0.0.1:{port}", "--disable-bringup", "--upstream-health-wait-ms", "0",
            "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        busy.close()
    assert proc.returncode == 2
    assert f"pylon: error: --http-listen-addr: cannot listen on 127.0.0.1:{port}" in err.decode()
    assert "Traceback" not in err.decode()


async def test_the_stargates_registered_with_are_counted_from_the_start(
    engine: FakeEngine, stargate: FakeStargate
) -> None:
    """A Pylon that never reached a Stargate had no per-router series, so no alert could see it."""
    unreached = make_app(engine, "127.0.0.1:9", "--model-name", "llama")
    app = make_app(engine, stargate, "--model-name", "llama")
    gauge = "pylon_registered_stargates"
    try:
        await unreached.start()
        assert unreached.metrics.registry.get_sample_value(gauge) == 0
        await app.start()
        await until("the stream acked", lambda: app.metrics.registry.get_sample_value(gauge) == 1)
        await stargate.close()
        await until("the stream lost", lambda: app.metrics.registry.get_sample_value(gauge) == 0)
    finally:
        await unreached.close()
        await app.close()
