"""Fuzzed registration streams against a real control plane on loopback: out-of-range and NaN/inf
stats, huge strings, missing fields, random bytes as the message. Each is acknowledged or rejected
with a status the spec names, never UNKNOWN/INTERNAL or a traceback, and a valid Pylon still
registers afterwards."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.control_plane import Harness, make_harness, message, send
from support.waiting import until

from stargate.bench.fuzz_registration import ACK, NO_ANSWER, exchange, raw_register
from stargate.proto import stargate_pb2 as pb
from stargate.router.control_plane import UNDECODABLE_MESSAGE
from stargate.wire.limits import U32_MAX, U64_MAX

ANSWER_TIMEOUT_S = 3.0
SPEC_ANSWERS = {ACK, NO_ANSWER, "INVALID_ARGUMENT", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED",
                "DEADLINE_EXCEEDED"}  # fmt: skip


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    async with make_harness() as value:
        yield value


def raw_call(h: Harness, metadata: tuple[tuple[str, str], ...] = ()) -> aio.StreamStreamCall:
    assert h.channel is not None
    return raw_register(h.channel)(metadata=metadata, timeout=10.0)


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records with a traceback from the control plane or grpc (the harness's fake /health server,
    probed by the registrations, is not under test)."""
    return [r for r in caplog.records if r.exc_info and r.name.startswith(("stargate", "grpc"))]


async def test_random_bytes_as_the_message_are_invalid_argument(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    call = raw_call(harness)
    await call.write(b"\xff\xff\xff\xff")
    with pytest.raises(aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == UNDECODABLE_MESSAGE
    assert not tracebacks(caplog), "a client's bytes logged a traceback"
    assert harness.state.registration_count() == 0


FLOATS = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308]), st.floats())
U64 = st.one_of(st.sampled_from([0, 1, U64_MAX, 2**63]), st.integers(min_value=0, max_value=U64_MAX))
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "x" * 100_000, "\u00e9" * 5000]))


@st.composite
def stats(draw: st.DrawFn) -> pb.ModelStats:
    s = pb.ModelStats(
        last_mean_input_tps=draw(FLOATS), output_tps=draw(FLOATS), max_output_tps=draw(FLOATS),
        queue_size=draw(U64), queued_input_size=draw(U64), kv_cache_capacity_tokens=draw(U64),
        kv_cache_used_tokens=draw(U64), kv_cache_free_tokens=draw(U64), num_running_queries=draw(U64),
        max_engine_concurrency=draw(U64), total_query_input_size=draw(U64),
        input_processing_queries=draw(U64), output_generation_queries=draw(U64),
        stats_observed_at_unix_ms=draw(U64), stats_capabilities=draw(st.lists(TEXT, max_size=2)),
    )  # fmt: skip
    for priority, estimate in draw(st.dictionaries(st.integers(0, U32_MAX), U64, max_size=3)).items():
        s.queue_time_estimate_ms_by_priority[priority] = estimate
    return s


@st.composite
def registrations(draw: st.DrawFn, url: str) -> pb.InferenceServerRegistration:
    msg = pb.InferenceServerRegistration(
        inference_server_id=draw(st.one_of(st.just("fuzz-1"), TEXT)),
        inference_server_url=draw(st.one_of(st.just(url), TEXT, st.sampled_from(["http://[::1", "http://h:99999"]))),
        cluster_id=draw(TEXT),
        reverse_tunnel=draw(st.booleans()),
    )  # fmt: skip
    for model_id in draw(st.lists(st.one_of(st.just("model-a"), TEXT), max_size=3)):
        entry = msg.models[model_id]
        entry.status = draw(st.sampled_from([0, 1, 1, 2, 7]))  # type: ignore[assignment]
        if draw(st.booleans()):
            entry.stats.CopyFrom(draw(stats()))
    return msg


HEARTBEAT = st.one_of(
    st.none(), st.sampled_from(["50", "abc", "9" * 40, "-1", ""]), st.from_regex(r"\A[ -~]{0,20}\Z")
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_fuzzed_registrations_are_acked_or_rejected_and_a_valid_pylon_still_registers(
    harness: Harness, caplog: pytest.LogCaptureFixture, data: st.DataObject
) -> None:
    beat = data.draw(HEARTBEAT)
    metadata = () if beat is None else (("x-stargate-registration-heartbeat-ms", beat),)
    if data.draw(st.booleans()):
        call = raw_call(harness, metadata)
        frames: list[object] = data.draw(st.lists(st.binary(max_size=200), min_size=1, max_size=3))
    else:
        call = harness.stub.RegisterInferenceServer(metadata=metadata, timeout=10.0)
        frames = data.draw(st.lists(registrations(harness.health.url), min_size=1, max_size=3))
    try:
        seen = await exchange(call, frames, ANSWER_TIMEOUT_S)
    finally:
        call.cancel()
    assert set(seen) <= SPEC_ANSWERS, seen
    assert not tracebacks(caplog), "a client's registration logged a traceback"

    # the cancelled stream is cleaned up, then a valid Pylon registers
    await until("the cancelled stream cleaned up", lambda: harness.state.registration_count() == 0)
    valid = harness.open()
    try:
        ack = await send(valid, message(harness.health.url, server_id="pylon-ok"))
        assert isinstance(ack, pb.InferenceServerAck)
    finally:
        valid.cancel()
    caplog.clear()
