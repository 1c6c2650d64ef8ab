"""Fuzzed registration streams for Stargate's control plane: out-of-range and NaN/inf stats, huge
strings, missing fields, unknown enum values, odd heartbeat metadata, random bytes as the message.

Most fuzzed registrations carry the URL of a live Pylon, so they are admitted and their stats reach
routing decisions for real requests; the rest must be rejected with the spec's status codes.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence

from grpc import aio

from stargate.bench import fuzz_cases as fc
from stargate.proto import stargate_pb2 as pb
from stargate.proto import stargate_pb2_grpc
from stargate.wire import headers as h
from stargate.wire.limits import U32_MAX, U64_MAX

REGISTER_METHOD = "/stargate.StargateControlPlane/RegisterInferenceServer"
ACK = "ack"
NO_ANSWER = "no answer"

_BAD_URLS = ("", "quic://1.2.3.4:5", "http://[::1", "http://h:99999", "http://" + "a" * 3000 + ":1")
_FLOATS = (math.nan, math.inf, -math.inf, -1.0, 0.0, 5e-324, 1e308, 1000.0)
_U64 = (0, 1, 2**32, 2**63, U64_MAX)
_U64_FIELDS = ("queue_size", "queued_input_size", "kv_cache_capacity_tokens", "kv_cache_used_tokens",
               "kv_cache_free_tokens", "num_running_queries", "max_engine_concurrency",
               "total_query_input_size", "input_processing_queries", "output_generation_queries")  # fmt: skip


def fuzz_stats(rng: random.Random) -> pb.ModelStats:
    stats = pb.ModelStats()
    for field in ("last_mean_input_tps", "output_tps", "max_output_tps"):
        setattr(stats, field, rng.choice(_FLOATS))
    for field in _U64_FIELDS:
        if rng.random() < 0.5:
            setattr(stats, field, rng.choice(_U64))
    for _ in range(rng.randrange(3)):
        stats.queue_time_estimate_ms_by_priority[rng.choice((0, 7, U32_MAX))] = rng.choice(_U64)
    return stats


def fuzz_registration(
    rng: random.Random, url: str, server_id: str, model: str
) -> pb.InferenceServerRegistration:
    """Usually admissible (the URL of a live backend, so its odd stats reach routing), often not."""
    msg = pb.InferenceServerRegistration(
        inference_server_id=rng.choice((server_id, server_id, server_id, "", fc.fuzz_text(rng, 300))),
        inference_server_url=rng.choice((url, url, url, url, url, *_BAD_URLS, fc.fuzz_text(rng, 20))),
        cluster_id=rng.choice(("", server_id, fc.fuzz_text(rng, 2000))),
        reverse_tunnel=rng.random() < 0.05,
    )  # fmt: skip
    for _ in range(rng.randrange(4)):
        entry = msg.models[rng.choice((model, model, "", "x" * 10_000, fc.fuzz_text(rng, 10)))]
        entry.status = rng.choice((0, 1, 1, 1, 2, 7))  # type: ignore[assignment]
        if rng.random() < 0.8:
            entry.stats.CopyFrom(fuzz_stats(rng))
    return msg


def fuzz_heartbeat(rng: random.Random) -> tuple[tuple[str, str], ...]:
    value = rng.choice(("50", "1000", "0", "abc", "-1", "9" * 40, "", None))
    return () if value is None else ((h.HEARTBEAT_METADATA, value),)


def raw_register(channel: aio.Channel) -> aio.StreamStreamMultiCallable:
    """``RegisterInferenceServer`` that sends bytes as they are (no serialisation)."""
    return channel.stream_stream(REGISTER_METHOD, request_serializer=bytes, response_deserializer=bytes)


async def exchange(call: aio.StreamStreamCall, frames: Sequence[object], timeout_s: float) -> list[str]:
    """Each frame written once the previous one was acknowledged; the answers (``ack`` per ack, then
    the status code that ended the stream), stopping early when the server goes quiet."""
    seen: list[str] = []
    try:
        for frame in frames:
            async with asyncio.timeout(timeout_s):
                await call.write(frame)
                try:
                    reply = await call.read()
                except aio.AioRpcError as exc:
                    seen.append(exc.code().name)
                    return seen
            if reply is aio.EOF:
                return seen
            seen.append(ACK)
    except TimeoutError:
        seen.append(NO_ANSWER)
    return seen


async def fuzz_stream(
    stub: stargate_pb2_grpc.StargateControlPlaneStub, raw: aio.StreamStreamMultiCallable,
    rng: random.Random, url: str, index: int, model: str, timeout_s: float,
) -> str:
    """One fuzzed stream (1-3 messages, or 1-3 frames of random bytes); the last answer it got."""
    metadata = fuzz_heartbeat(rng)
    frames: list[object]
    if rng.random() < 0.2:
        call = raw(metadata=metadata, timeout=timeout_s * 4)
        frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 4))]
    else:
        call = stub.RegisterInferenceServer(metadata=metadata, timeout=timeout_s * 4)
        frames = [fuzz_registration(rng, url, f"fuzz-{index}", model) for _ in range(rng.randrange(1, 4))]
    try:
        seen = await exchange(call, frames, timeout_s)
    finally:
        call.cancel()
    return seen[-1] if seen else NO_ANSWER
