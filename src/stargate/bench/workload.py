"""Workload generation: a scenario and a seed become a fixed list of planned requests (spec §4).

Unlike the original (one RNG for everything), each dimension draws from its own ``random.Random``
derived from the seed (:func:`streams`): arrivals, keys, request classes, input sizes, output sizes,
session turns and think times; prompt text has one stream per key (``prompts.py``). Changing one
distribution therefore never shifts the draws of another. The semantics of the six original kinds
are those of spec §3.5; ``zipf``, ``sessions`` and ``trace`` are extensions.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import orjson

from stargate.bench import mooncake
from stargate.bench.prompts import PromptBuilder
from stargate.bench.schema import MAX_SCHEDULE_S, MAX_TOKENS, Scenario
from stargate.bench.traffic import (
    Arrival,
    BurstyTraffic,
    ConstantArrival,
    ConstantTokens,
    GammaArrival,
    LognormalTokens,
    MixedSizeTraffic,
    PoissonArrival,
    PrefixReuseTraffic,
    SessionsTraffic,
    StairStepTraffic,
    TokenDist,
    TraceTraffic,
    UniformTokens,
    UniformTraffic,
    ZipfHotsetTraffic,
    ZipfTraffic,
)
from stargate.errors import ConfigError
from stargate.wire import headers as h

DIMENSIONS = ("arrivals", "keys", "classes", "input", "output", "turns", "think")


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    request_id: str
    model: str
    at_ms: float | None  # open loop: offset from replay start; None inside closed-loop sessions
    session: str | None
    turn: int
    input_tokens: int
    output_tokens: int
    routing_key: str | None
    cache_affinity_key: str | None
    headers: dict[str, str]
    body: bytes
    behavior_class: str
    think_ms: float = 0.0  # closed loop: pause after the previous turn ended, before this one starts


@dataclass(frozen=True)
class Workload:
    mode: Literal["open", "closed"]
    requests: tuple[PlannedRequest, ...]
    sessions: tuple[tuple[PlannedRequest, ...], ...]
    max_concurrency: int
    client_timeout_s: float
    duration_s: float | None = None
    seed: int = 0


def streams(seed: int) -> dict[str, random.Random]:
    """Independent generators, one per dimension, all fixed by ``seed``."""
    return {name: random.Random(f"stargate-bench:{seed}:{name}") for name in DIMENSIONS}


def round_half_away(value: float) -> int:
    return math.floor(abs(value) + 0.5) * (1 if value >= 0 else -1)


def _open_unit(rng: random.Random) -> float:
    while True:
        u = rng.random()
        if u > 0.0:
            return u


def sample_tokens(dist: TokenDist, rng: random.Random) -> int:
    if isinstance(dist, ConstantTokens):
        return dist.value
    if isinstance(dist, UniformTokens):
        return rng.randint(dist.min, dist.max)
    assert isinstance(dist, LognormalTokens)
    z = math.sqrt(-2.0 * math.log(_open_unit(rng))) * math.cos(2.0 * math.pi * _open_unit(rng))
    exponent = min(math.log(dist.mean) + dist.sigma * z, 700.0)  # exp overflows past ~709
    value = max(1, round_half_away(math.exp(exponent)))
    if dist.min is not None:
        value = max(value, dist.min)
    if dist.p99_cap is not None:
        value = min(value, dist.p99_cap)
    return value


def poisson_gap_ms(rps: float, rng: random.Random) -> int:
    """Original rule: round(1000 · (-ln U) / rps) whole milliseconds."""
    return round_half_away(1000.0 * -math.log(_open_unit(rng)) / rps)


def arrival_gap_ms(arrival: Arrival, rng: random.Random) -> float:
    if isinstance(arrival, ConstantArrival):
        return float(arrival.interval_ms)
    if isinstance(arrival, PoissonArrival):
        return float(poisson_gap_ms(arrival.target_rps, rng))
    assert isinstance(arrival, GammaArrival)
    shape = 1.0 / (arrival.cv * arrival.cv)
    return rng.gammavariate(shape, 1000.0 / arrival.target_rps / shape)


def _key(prefix: str, count: int, rng: random.Random) -> str | None:
    return f"{prefix}-{rng.randrange(count):04d}" if count > 0 else None


@dataclass
class _Shape:
    """One request before rendering; ``at_ms`` is None for closed-loop sessions."""

    at_ms: float | None
    routing_key: str | None
    cache_key: str | None
    input_tokens: int
    output_tokens: int
    behavior_class: str
    session: str | None = None
    turn: int = 0
    think_ms: float = 0.0
    prompt: str | None = None


def _gap(traffic: object, index: int, rng: random.Random) -> float:
    if isinstance(traffic, BurstyTraffic):
        burst = (index // traffic.burst_period_requests) % 2 == 0
        return float(poisson_gap_ms(traffic.burst_rps if burst else traffic.quiet_rps, rng))
    if isinstance(traffic, StairStepTraffic):
        rps = traffic.start_rps + (index // traffic.step_requests) * traffic.step_rps
        return float(poisson_gap_ms(rps, rng))
    assert hasattr(traffic, "arrival")
    return arrival_gap_ms(traffic.arrival, rng)


def _zipf_cumulative(count: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(rank ** -exponent for rank in range(1, count + 1)))


def _synthetic(scenario: Scenario, rngs: dict[str, random.Random]) -> list[_Shape]:
    traffic = scenario.traffic_pattern
    keys, classes = rngs["keys"], rngs["classes"]
    inputs, outputs = rngs["input"], rngs["output"]
    offset = 0.0
    sessions: dict[str, int] = {}
    visits: dict[str, int] = {}
    cumulative = (
        _zipf_cumulative(traffic.cache_affinity_keys, traffic.exponent)
        if isinstance(traffic, ZipfTraffic) and traffic.cache_affinity_keys > 0
        else []
    )
    shapes = []
    for index in range(scenario.request_count):
        if index > 0:
            offset += _gap(traffic, index, rngs["arrivals"])
        if isinstance(traffic, UniformTraffic | BurstyTraffic | StairStepTraffic):
            routing = _key("rk", traffic.routing_keys, keys)
            cache = _key("cak", traffic.cache_affinity_keys, keys)
            shape = _Shape(offset, routing, cache, sample_tokens(traffic.input_tokens, inputs),
                           sample_tokens(traffic.output_tokens, outputs), traffic.kind)  # fmt: skip
        elif isinstance(traffic, MixedSizeTraffic):
            small = classes.random() < traffic.small_share
            size = traffic.small if small else traffic.large
            routing = _key("rk", traffic.routing_keys, keys)
            cache = _key("cak", traffic.cache_affinity_keys, keys)
            shape = _Shape(offset, routing, cache, sample_tokens(size.input_tokens, inputs),
                           sample_tokens(size.output_tokens, outputs),
                           "small" if small else "large")  # fmt: skip
        elif isinstance(traffic, ZipfHotsetTraffic):
            count = traffic.cache_affinity_keys
            hot_count = 0
            if count > 0 and traffic.hotset_fraction > 0:
                hot_count = min(max(round_half_away(count * traffic.hotset_fraction), 1), count)
            hot = hot_count > 0 and classes.random() < traffic.hotset_share
            cache = _key("cak", hot_count if hot else count, keys)
            routing = _key("rk", traffic.routing_keys, keys)
            shape = _Shape(offset, routing, cache, sample_tokens(traffic.input_tokens, inputs),
                           sample_tokens(traffic.output_tokens, outputs),
                           "hot" if hot else "cold")  # fmt: skip
        elif isinstance(traffic, ZipfTraffic):
            cache = None
            if cumulative:
                rank = bisect.bisect_left(cumulative, keys.random() * cumulative[-1])
                cache = f"cak-{min(rank, len(cumulative) - 1):04d}"
            routing = _key("rk", traffic.routing_keys, keys)
            shape = _Shape(offset, routing, cache, sample_tokens(traffic.input_tokens, inputs),
                           sample_tokens(traffic.output_tokens, outputs), "zipf")  # fmt: skip
        else:
            assert isinstance(traffic, PrefixReuseTraffic)
            cache = _key("cak", traffic.cache_affinity_keys, keys)
            assert cache is not None
            previous = sessions.get(cache)
            if previous is None:
                tokens = max(1, sample_tokens(traffic.initial_input_tokens, inputs))
            else:
                tokens = previous + sample_tokens(traffic.incremental_input_tokens, inputs)
            sessions[cache] = tokens
            turn = visits.get(cache, 0)
            visits[cache] = turn + 1
            routing = _key("rk", traffic.routing_keys, keys)
            shape = _Shape(offset, routing, cache, tokens, sample_tokens(traffic.output_tokens, outputs),
                           "prefix_reuse", session=cache, turn=turn)  # fmt: skip
        shapes.append(shape)
    return shapes


def _sessions(scenario: Scenario, traffic: SessionsTraffic, rngs: dict[str, random.Random]) -> list[_Shape]:
    shapes: list[_Shape] = []
    for number in itertools.count():
        if len(shapes) >= scenario.request_count:
            break
        session = f"session-{number:05d}"
        routing = _key("rk", traffic.routing_keys, rngs["keys"])
        turns = max(1, sample_tokens(traffic.turns, rngs["turns"]))
        tokens = 0
        previous_output = 0
        for turn in range(min(turns, scenario.request_count - len(shapes))):
            if turn == 0:
                tokens = max(1, sample_tokens(traffic.initial_input_tokens, rngs["input"]))
                think = 0.0
            else:
                grow = previous_output if traffic.context_includes_output else 0
                tokens += grow + sample_tokens(traffic.incremental_input_tokens, rngs["input"])
                think = float(sample_tokens(traffic.think_time_ms, rngs["think"]))
            output = sample_tokens(traffic.output_tokens, rngs["output"])
            previous_output = output
            shapes.append(_Shape(None, routing, session, tokens, output, "sessions",
                                 session=session, turn=turn, think_ms=think))  # fmt: skip
    return shapes


def _trace_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """The trace's numbered lines, read as they are taken: a replay of a few rows of a large trace
    reads only those."""
    try:
        with path.open("rb") as file:
            yield from enumerate(file, 1)
    except OSError as exc:
        reason = f"cannot read trace {path}: {exc.strerror or exc}"
        raise ConfigError(reason, path="$.traffic_pattern.path") from exc


def _enough(scenario: Scenario, path: Path, shapes: list[_Shape]) -> list[_Shape]:
    if len(shapes) < scenario.request_count:
        raise ConfigError(
            f"trace has {len(shapes)} requests, fewer than request_count ({scenario.request_count})",
            path=f"$.traffic_pattern.path ({path})",
        )
    return shapes


def _trace(scenario: Scenario, traffic: TraceTraffic, prompts: PromptBuilder) -> list[_Shape]:
    if traffic.format == "mooncake":
        return _mooncake(scenario, traffic, prompts)
    path = (scenario.base_dir / traffic.path).resolve()
    shapes: list[_Shape] = []
    turns: dict[str, int] = {}
    stamps: list[float] = []
    for number, line in _trace_lines(path):
        if not line.strip():
            continue
        where = f"$.traffic_pattern.path ({path}:{number})"
        what = "bad trace line"
        row = mooncake.json_row(line, what, where)
        stamp = mooncake.number_field(row, "timestamp_ms", what, where)
        input_tokens = mooncake.integer_field(row, "input_tokens", what, where)
        output_tokens = mooncake.integer_field(row, "output_tokens", what, where)
        session = mooncake.text_field(row, "session", what, where)
        prompt = mooncake.text_field(row, "prompt", what, where)
        routing = mooncake.text_field(row, "routing_key", what, where)
        mooncake.check_tokens(("input_tokens", input_tokens), ("output_tokens", output_tokens), where=where)
        turn = turns.get(session, 0) if session else 0
        if session:
            turns[session] = turn + 1
        stamps.append(stamp)
        shapes.append(_Shape(None, routing, session, input_tokens, output_tokens, "trace",
                             session=session, turn=turn, prompt=prompt))  # fmt: skip
        if len(shapes) >= scenario.request_count:
            break  # the rest of the file is never read
    start = min(stamps, default=0.0)  # the earliest row, which need not be the first
    for shape, stamp in zip(shapes, stamps, strict=True):
        shape.at_ms = (stamp - start) * traffic.time_scale
    return _enough(scenario, path, shapes)


def _token_fields(traffic: object, shape: _Shape) -> tuple[str, str]:
    """The fields a synthetic request's input and output token counts were drawn from."""
    if isinstance(traffic, MixedSizeTraffic):
        return f"{shape.behavior_class}.input_tokens", f"{shape.behavior_class}.output_tokens"
    if isinstance(traffic, PrefixReuseTraffic | SessionsTraffic):
        grown = "incremental_input_tokens" if shape.turn else "initial_input_tokens"
        return grown, "output_tokens"
    return "input_tokens", "output_tokens"


def _check_tokens(traffic: object, shapes: list[_Shape]) -> None:
    """Every prompt and answer within :data:`MAX_TOKENS`, checked before any prompt text is built."""
    for index, shape in enumerate(shapes):
        for field, tokens in zip(_token_fields(traffic, shape), (shape.input_tokens, shape.output_tokens),
                                 strict=True):  # fmt: skip
            if tokens > MAX_TOKENS:
                reason = f"request {index} would have {tokens} tokens, over the limit of {MAX_TOKENS}"
                raise ConfigError(reason, path=f"$.traffic_pattern.{field}")


def _schedule_field(scenario: Scenario, traffic: object) -> str:
    if isinstance(traffic, TraceTraffic):
        return f"$.traffic_pattern.path ({(scenario.base_dir / traffic.path).resolve()})"
    if isinstance(traffic, SessionsTraffic):
        return "$.traffic_pattern.think_time_ms"
    return "$.traffic_pattern.arrival" if hasattr(traffic, "arrival") else "$.traffic_pattern"


def _check_schedule(scenario: Scenario, traffic: object, shapes: list[_Shape]) -> None:
    """Every wait the replay has within :data:`MAX_SCHEDULE_S`, so a run cannot wait for ever.

    Requests that ``execution.duration_s`` leaves out are never waited for.
    """
    limit_ms = MAX_SCHEDULE_S * 1000.0
    stop_ms = math.inf if scenario.execution.duration_s is None else scenario.execution.duration_s * 1000.0
    thinking: dict[str | None, float] = {}
    closed = scenario.effective_mode == "closed_loop"
    for index, shape in enumerate(shapes):
        if not closed:
            at_ms = shape.at_ms or 0.0
            late = at_ms < stop_ms and not at_ms <= limit_ms
            reason = f"request {index} would start {at_ms / 1000.0:.6g} s after the first"
        else:
            thinking[shape.session] = thinking.get(shape.session, 0.0) + shape.think_ms
            late = thinking[shape.session] > limit_ms
            reason = f"session {shape.session} would think {thinking[shape.session] / 1000.0:.6g} s in all"
        if late:
            scale = " (after time_scale)" if isinstance(traffic, TraceTraffic) else ""
            reason += f"{scale}, over the limit of {MAX_SCHEDULE_S:.0f} s (24 h)"
            raise ConfigError(reason, path=_schedule_field(scenario, traffic))


def _mooncake(scenario: Scenario, traffic: TraceTraffic, prompts: PromptBuilder) -> list[_Shape]:
    """Mooncake rows: prompts rebuilt block by block, the conversation key as the cache key."""
    path = (scenario.base_dir / traffic.path).resolve()
    rows: list[mooncake.MooncakeRow] = []
    for number, line in _trace_lines(path):
        if line.strip():
            rows.append(mooncake.parse_row(line, f"$.traffic_pattern.path ({path}:{number})"))
            if len(rows) >= scenario.request_count:
                break  # the rest of the file is never read
    requests = mooncake.replay_requests(rows, prompts, traffic.block_tokens, traffic.time_scale)
    return _enough(scenario, path, [
        _Shape(r.at_ms, None, r.conversation, r.input_tokens, r.output_tokens, "trace",
               session=r.conversation, turn=r.turn, prompt=r.prompt)
        for r in requests
    ])  # fmt: skip


def _render(scenario: Scenario, seed: int, index: int, shape: _Shape, prompts: PromptBuilder,
            closed: bool) -> PlannedRequest:  # fmt: skip
    request_id = f"{scenario.slug}-{seed}-{index:06d}"
    client = scenario.client
    headers = {
        "content-type": "application/json",
        h.REQUEST_ID: request_id,
        h.MODEL: scenario.model,
        h.INPUT_TOKENS: str(shape.input_tokens),
        h.OUTPUT_TOKENS: str(shape.output_tokens),
    }
    if shape.routing_key is not None:
        headers[h.ROUTING_KEY] = shape.routing_key
    if shape.cache_key is not None:
        headers[h.CACHE_AFFINITY_KEY] = shape.cache_key
    if client.priority is not None:
        headers[h.PRIORITY] = str(client.priority)
    if client.max_wait_ms is not None:
        headers[h.MAX_WAIT_MS] = str(client.max_wait_ms)
    if client.request_slo_ms is not None:
        headers[h.REQUEST_SLO_MS] = str(client.request_slo_ms)
    headers.update({name.lower(): value for name, value in client.headers.items()})
    if shape.prompt is not None:
        messages = [{"role": "user", "content": shape.prompt}]
    else:
        messages = prompts.messages(shape.session or shape.cache_key or request_id, shape.input_tokens)
    payload = {"model": scenario.model, "messages": messages, "max_tokens": shape.output_tokens}
    body = orjson.dumps({**payload, "stream": client.stream})
    return PlannedRequest(
        index=index,
        request_id=request_id,
        model=scenario.model,
        at_ms=None if closed else shape.at_ms,
        session=shape.session,
        turn=shape.turn,
        input_tokens=shape.input_tokens,
        output_tokens=shape.output_tokens,
        routing_key=shape.routing_key,
        cache_affinity_key=shape.cache_key,
        headers=headers,
        body=body,
        behavior_class=shape.behavior_class,
        think_ms=shape.think_ms if closed else 0.0,
    )


def build_workload(scenario: Scenario, seed: int | None = None) -> Workload:
    """The same scenario and seed always give the same workload, byte for byte."""
    effective = scenario.effective_seed(seed)
    rngs = streams(effective)
    traffic = scenario.traffic_pattern
    prompts = PromptBuilder(
        seed=effective,
        vocabulary_size=scenario.prompts.vocabulary_size,
        vocabulary_seed=scenario.prompts.vocabulary_seed,
        shared_prefix_tokens=scenario.prompts.shared_prefix_tokens,
        repeat=scenario.prompts.text == "repeat",
    )
    try:
        if isinstance(traffic, SessionsTraffic):
            shapes = _sessions(scenario, traffic, rngs)
        elif isinstance(traffic, TraceTraffic):
            shapes = _trace(scenario, traffic, prompts)
        else:
            shapes = _synthetic(scenario, rngs)
        _check_tokens(traffic, shapes)
        _check_schedule(scenario, traffic, shapes)
    except ConfigError as exc:
        raise exc.in_file(exc.file or scenario.file) from None
    closed = scenario.effective_mode == "closed_loop"
    requests = [_render(scenario, effective, i, shape, prompts, closed) for i, shape in enumerate(shapes)]
    if not closed:
        requests.sort(key=lambda r: (r.at_ms or 0.0, r.index))
    groups: dict[str, list[PlannedRequest]] = {}
    singles: list[tuple[int, tuple[PlannedRequest, ...]]] = []
    for request in requests:
        if request.session is None:
            singles.append((request.index, (request,)))
        else:
            groups.setdefault(request.session, []).append(request)
    sessions = sorted([*singles, *((g[0].index, tuple(g)) for g in groups.values())], key=lambda s: s[0])
    workers = scenario.execution.workers or scenario.max_concurrency
    return Workload(
        mode="closed" if closed else "open",
        requests=tuple(requests),
        sessions=tuple(group for _, group in sessions) if closed else (),
        max_concurrency=workers if closed else scenario.max_concurrency,
        client_timeout_s=scenario.client.timeout_s,
        duration_s=scenario.execution.duration_s,
        seed=effective,
    )
