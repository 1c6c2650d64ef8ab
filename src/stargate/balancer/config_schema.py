"""Field schema of one detailed `lb-config.json` entry (spec §2.4), checked with pydantic.

Each algorithm has its own strict model (``extra="forbid"``): integers must be JSON integers, f64
fields accept integers, booleans must be booleans. Pydantic's errors are translated here into the
project's own messages so that a user sees the same wording as the original router
(``round-robin config does not support field(s): seed``, ``invalid type: null, ...``) and the JSON
path of the offending field. ``algorithm`` and ``request_algorithms`` are handled by the caller.

``normalise`` then applies the defaults of §2.5, producing the definition; the registry checks it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from stargate.balancer.settings import (
    Algorithm,
    AlgorithmDefinition,
    Comparator,
    Placement,
    PrefillEstimate,
    PrefillRate,
)
from stargate.errors import ConfigError
from stargate.wire.limits import U64_MAX

U64 = Annotated[int, Field(ge=0, le=U64_MAX)]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def child_path(path: str, key: str) -> str:
    """JSON path of ``key`` under ``path``: ``$.models["model-a"].sample_count`` style."""
    if _IDENTIFIER.match(key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def describe_json(value: object) -> str:
    """Name a JSON value the way type errors report it (``null``, ``floating point `1.5```...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f"string {json.dumps(value, ensure_ascii=False)}"
    if isinstance(value, list | tuple):
        return "sequence"
    if isinstance(value, Mapping):
        return "map"
    return type(value).__name__


class Fields(BaseModel):
    """Fields every algorithm takes; each algorithm's schema adds its own."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    require_cache_affinity_key: bool = False
    require_input_tokens: bool = False
    max_input_work_seconds: float | None = None


class _ComparatorFields(Fields):
    comparator: Annotated[Comparator, Field(strict=False)] | None = None  # lax: JSON gives the value

    @field_validator("comparator", mode="before")
    @classmethod
    def _comparator_not_null(cls, value: object) -> object:
        # Absent means "use the default"; an explicit null is a type error, as in the original.
        if value is None:
            raise PydanticCustomError("comparator_null", "invalid type: null, expected a comparator name")
        return value


class RoundRobinFields(Fields):
    pass


class RandomFields(Fields):
    pass


class PowerOfNFields(_ComparatorFields):
    sample_count: int = 2
    load_aware: bool = False
    prefill_rate: Literal["published", "measured"] | None = None


class PulsarFields(Fields):
    seed: str | None = None
    consider_kv_free_tokens: bool = False


class _WaitAndWidenFamilyFields(_ComparatorFields):
    """Tuning fields shared by wait-and-widen and pulsar-wait-and-widen; ``null`` = unset."""

    seed: str | None = None
    cache_affinity_virtual_nodes: U64 | None = None
    cache_affinity_backend_selection_count: U64 | None = None
    max_queue_time_floor_ms: U64 | None = None
    max_queue_time_ceil_ms: U64 | None = None
    ttft_bucket_size_ms: U64 | None = None
    next_bucket_unlock_factor: float | None = None
    n: U64 | None = None
    max_queued: U64 | None = None
    ignore_queue_time: bool | None = None
    ignore_input_processing_time: bool | None = None
    cache_affinity_wait_ms: U64 | None = None
    cache_affinity_input_tokens_scale: float | None = None


class WaitAndWidenFields(_WaitAndWidenFamilyFields):
    load_aware: bool | None = None
    prefill_rate: Literal["published", "measured"] | None = None
    cache_affinity_yield_margin_ms: U64 | None = None
    cache_affinity_placement: Literal["ring", "load"] | None = None
    cache_affinity_prefill: Literal["scale", "growth"] | None = None
    cache_affinity_await_prefill: bool | None = None
    cache_affinity_spill: bool | None = None
    prefill_sharing: bool | None = None


class PulsarWaitAndWidenFields(_WaitAndWidenFamilyFields):
    consider_kv_free_tokens: bool | None = None


COMPARATOR_NAMES = ", ".join(c.value for c in Comparator)


def parse_fields(algorithm: Algorithm, schema: type[Fields], fields: Mapping[str, Any], path: str) -> Fields:
    """Validate the fields of a detailed entry (without ``algorithm``/``request_algorithms``)."""
    try:
        return schema.model_validate(dict(fields))
    except ValidationError as exc:
        raise _translate(algorithm, exc.errors(include_url=False), path) from None


def _translate(algorithm: Algorithm, errors: list[ErrorDetails], path: str) -> ConfigError:
    unsupported = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unsupported:
        return ConfigError(
            f"{algorithm.value} config does not support field(s): {', '.join(unsupported)}", path=path
        )
    error = errors[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    field_path = child_path(path, field) if field else path
    return ConfigError(_reason(error, field), path=field_path)


def _reason(error: ErrorDetails, field: str) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "int_type":
        return f"invalid type: {describe_json(value)}, expected an unsigned integer for {field}"
    if kind in ("greater_than_equal", "less_than_equal"):
        return f"invalid value: {describe_json(value)}, expected an integer in 0..={U64_MAX} for {field}"
    if kind == "float_type":
        return f"invalid type: {describe_json(value)}, expected a number for {field}"
    if kind == "bool_type":
        return f"invalid type: {describe_json(value)}, expected a boolean for {field}"
    if kind == "string_type":
        return f"invalid type: {describe_json(value)}, expected a string for {field}"
    if kind == "literal_error" and field == "cache_affinity_placement":
        names = ", ".join(p.value for p in Placement)
        return f"unknown cache_affinity_placement {describe_json(value)}, expected one of: {names}"
    if kind == "literal_error" and field == "cache_affinity_prefill":
        names = ", ".join(p.value for p in PrefillEstimate)
        return f"unknown cache_affinity_prefill {describe_json(value)}, expected one of: {names}"
    if kind == "literal_error" and field == "prefill_rate":
        names = ", ".join(p.value for p in PrefillRate)
        return f"unknown prefill_rate {describe_json(value)}, expected one of: {names}"
    if kind == "enum":
        return f"unknown comparator {describe_json(value)}, expected one of: {COMPARATOR_NAMES}"
    if kind == "comparator_null":
        return f"invalid type: null, expected a comparator name (one of: {COMPARATOR_NAMES})"
    return f"{error['msg']} for {field}" if field else error["msg"]


def normalise(algorithm: Algorithm, fields: Fields, comparator: Comparator | None) -> AlgorithmDefinition:
    """Apply the defaults of §2.5 to parsed fields; ``comparator`` is the algorithm's default (§2.7).

    What the schema cannot see (ranges, settings an algorithm ignores) is checked on the result by
    :func:`stargate.balancer.registry.check_definition`.
    """
    settings: dict[str, Any] = {
        "require_cache_affinity_key": fields.require_cache_affinity_key,
        "require_input_tokens": fields.require_input_tokens,
        "max_input_work_seconds": fields.max_input_work_seconds,
        "comparator": comparator,
    }
    if isinstance(fields, _ComparatorFields) and fields.comparator is not None:
        settings["comparator"] = fields.comparator
    if isinstance(fields, PowerOfNFields):
        settings["sample_count"] = fields.sample_count
        settings["load_aware"] = fields.load_aware
        settings["prefill_rate"] = PrefillRate(fields.prefill_rate or "published")
    elif isinstance(fields, PulsarFields):
        settings["seed"] = fields.seed or ""
        settings["consider_kv_free_tokens"] = fields.consider_kv_free_tokens
    elif isinstance(fields, _WaitAndWidenFamilyFields):
        settings.update(_wait_and_widen_settings(fields))
    # `require_input_tokens` is reported true whenever the KV free-token check needs the count.
    settings["require_input_tokens"] = settings["require_input_tokens"] or settings.get(
        "consider_kv_free_tokens", False
    )
    return AlgorithmDefinition(algorithm=algorithm, **settings)


def _wait_and_widen_settings(fields: _WaitAndWidenFamilyFields) -> dict[str, Any]:
    """§3.4 normalisation; "unset" is absent or null, an explicit 0 is not unset."""
    scale = fields.cache_affinity_input_tokens_scale
    floor, ceil = fields.max_queue_time_floor_ms, fields.max_queue_time_ceil_ms
    nodes, count = fields.cache_affinity_virtual_nodes, fields.cache_affinity_backend_selection_count
    bucket, factor = fields.ttft_bucket_size_ms, fields.next_bucket_unlock_factor
    settings: dict[str, Any] = {
        "seed": fields.seed or "",
        "virtual_nodes": max(1, 150 if nodes is None else nodes),
        "selection_count": count if count else None,
        "queue_slo_ms": (floor, ceil) if floor is not None and ceil is not None else None,
        "ttft_bucket_size_ms": 20 if bucket is None else bucket,
        "next_bucket_unlock_factor": 0.25 if factor is None else factor,
        "n": max(1, 2 if fields.n is None else fields.n),
        "max_queued": fields.max_queued or 0,
        "ignore_queue_time": bool(fields.ignore_queue_time),
        "ignore_input_processing_time": bool(fields.ignore_input_processing_time),
        "cache_affinity_wait_ms": fields.cache_affinity_wait_ms or 0,
        "cache_affinity_input_tokens_scale": 1.0 if scale is None else float(scale),
    }
    if isinstance(fields, PulsarWaitAndWidenFields):
        settings["consider_kv_free_tokens"] = bool(fields.consider_kv_free_tokens)
    if isinstance(fields, WaitAndWidenFields):
        settings["load_aware"] = bool(fields.load_aware)
        settings["prefill_rate"] = PrefillRate(fields.prefill_rate or "published")
        settings["cache_affinity_yield_margin_ms"] = fields.cache_affinity_yield_margin_ms
        settings["cache_affinity_placement"] = Placement(fields.cache_affinity_placement or "ring")
        settings["cache_affinity_prefill"] = PrefillEstimate(fields.cache_affinity_prefill or "scale")
        settings["cache_affinity_await_prefill"] = bool(fields.cache_affinity_await_prefill)
        settings["cache_affinity_spill"] = bool(fields.cache_affinity_spill)
        settings["prefill_sharing"] = bool(fields.prefill_sharing)
    return settings
