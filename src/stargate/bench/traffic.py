"""Traffic in a scenario file (bench spec §3.5 plus extensions): token laws, arrivals, patterns.

Every model forbids unknown keys. Extensions are new traffic kinds (``zipf``, ``sessions``, ``trace``)
and the ``gamma`` arrival law; every original key keeps its name and default.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stargate.wire.limits import U64_MAX

U64 = Annotated[int, Field(ge=0, le=U64_MAX)]
Positive = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveFloat = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class Strict(BaseModel):
    """Unknown keys are an error (a typo must not silently fall back to a default), and so is a value
    of the wrong type: ``true`` is not a count, ``"2"`` not a number, ``"yes"`` not a boolean, ``1.0``
    not an integer (an integer is a number)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# --- distributions (spec §3.5) ---------------------------------------------------------------


class ConstantTokens(Strict):
    distribution: Literal["constant"]
    value: U64


class UniformTokens(Strict):
    distribution: Literal["uniform"]
    min: U64
    max: U64

    @model_validator(mode="after")
    def _ordered(self) -> UniformTokens:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class LognormalTokens(Strict):
    """``mean`` is the median of the law (the original's naming), ``p99_cap`` a hard cap."""

    distribution: Literal["lognormal"]
    mean: PositiveFloat
    sigma: PositiveFloat
    min: U64 | None = None
    p99_cap: U64 | None = None


TokenDist = Annotated[ConstantTokens | UniformTokens | LognormalTokens, Field(discriminator="distribution")]


class ConstantArrival(Strict):
    distribution: Literal["constant"]
    interval_ms: U64


class PoissonArrival(Strict):
    distribution: Literal["poisson"]
    target_rps: PositiveFloat


class GammaArrival(Strict):
    """Extension: gamma-distributed gaps with mean 1/rps and coefficient of variation ``cv``."""

    distribution: Literal["gamma"]
    target_rps: PositiveFloat
    cv: PositiveFloat


Arrival = Annotated[ConstantArrival | PoissonArrival | GammaArrival, Field(discriminator="distribution")]


# --- traffic patterns (spec §3.5 plus extensions) --------------------------------------------


class _Keys(Strict):
    routing_keys: U64 = 0
    cache_affinity_keys: U64 = 0


class UniformTraffic(_Keys):
    kind: Literal["uniform"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class ZipfHotsetTraffic(_Keys):
    kind: Literal["zipf_hotset"]
    hotset_fraction: Fraction
    hotset_share: Fraction
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class BurstyTraffic(_Keys):
    kind: Literal["bursty"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    quiet_rps: PositiveFloat
    burst_rps: PositiveFloat
    burst_period_requests: Positive


class StairStepTraffic(_Keys):
    kind: Literal["stair_step"]
    input_tokens: TokenDist
    output_tokens: TokenDist
    start_rps: PositiveFloat
    step_rps: Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
    step_requests: Positive


class SizeClass(Strict):
    input_tokens: TokenDist
    output_tokens: TokenDist


class MixedSizeTraffic(_Keys):
    kind: Literal["mixed_size"]
    arrival: Arrival
    small: SizeClass
    large: SizeClass
    small_share: Fraction


class PrefixReuseTraffic(_Keys):
    kind: Literal["prefix_reuse"]
    initial_input_tokens: TokenDist
    incremental_input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival

    @model_validator(mode="after")
    def _needs_keys(self) -> PrefixReuseTraffic:
        if self.cache_affinity_keys == 0:
            raise ValueError("prefix_reuse needs cache_affinity_keys > 0")
        return self


class ZipfTraffic(_Keys):
    """Extension: a true Zipf law over cache keys, P(rank r) ∝ r^-exponent."""

    kind: Literal["zipf"]
    exponent: PositiveFloat
    input_tokens: TokenDist
    output_tokens: TokenDist
    arrival: Arrival


class SessionsTraffic(Strict):
    """Extension: closed-loop multi-turn sessions; each session is one conversation (its own key).

    Turn k+1 starts after turn k ended plus a think time; its input is the previous input plus the
    previous output (when ``context_includes_output``) plus a fresh increment.
    """

    kind: Literal["sessions"]
    routing_keys: U64 = 0
    turns: TokenDist
    think_time_ms: TokenDist = ConstantTokens(distribution="constant", value=0)
    initial_input_tokens: TokenDist
    incremental_input_tokens: TokenDist
    output_tokens: TokenDist
    context_includes_output: bool = True


class TraceTraffic(Strict):
    """Extension: replay a JSONL trace (path relative to the scenario file), open loop by timestamp.

    ``format: stargate`` lines: ``timestamp_ms``, ``session`` (or null), ``input_tokens``,
    ``output_tokens`` and optionally ``prompt`` (text sent verbatim) and ``routing_key``.
    ``format: mooncake`` lines: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``
    of ``block_tokens``-token blocks (:mod:`stargate.bench.mooncake`). Offsets are multiplied by
    ``time_scale``.
    """

    kind: Literal["trace"]
    path: str = Field(min_length=1)
    format: Literal["stargate", "mooncake"] = "stargate"
    block_tokens: Positive = 512
    time_scale: PositiveFloat = 1.0


TrafficPattern = Annotated[
    UniformTraffic
    | ZipfHotsetTraffic
    | BurstyTraffic
    | StairStepTraffic
    | MixedSizeTraffic
    | PrefixReuseTraffic
    | ZipfTraffic
    | SessionsTraffic
    | TraceTraffic,
    Field(discriminator="kind"),
]

