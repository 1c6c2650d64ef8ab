"""`lb-config.json`: parsing into normalised definitions, and per-request algorithm resolution.

Spec §2. ``parse_lb_config`` turns decoded JSON into an immutable ``LbConfig``; every configured
entry becomes exactly one ``AlgorithmDefinition`` object, and ``LbConfig.resolve`` always returns
those same objects, so a header override that matches a model's configured algorithm shares the
configured policy instance (and its counters) with header-less requests (§2.8 rule 1).

Every problem raises ``ConfigError`` with the JSON path of the offending value
(``$.models["model-a"].sample_count``); nothing else escapes the parser.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from types import MappingProxyType
from typing import Any

from stargate.balancer.config_schema import child_path, describe_json, normalise, parse_fields
from stargate.balancer.registry import (
    ALIASES,
    SPECS,
    check_definition,
    default_comparator,
    default_definition,
)
from stargate.balancer.settings import Algorithm, AlgorithmDefinition
from stargate.errors import ConfigError, UnavailableRoutingMethod, UnknownRoutingMethod

MAX_CONFIG_BYTES = 16 * 1024 * 1024
# Entries under `request_algorithms` may nest further maps that are validated and ignored; the cap
# keeps a hostile file from exhausting the interpreter's stack.
MAX_NESTING = 8
ENTRY_TYPE_ERROR = "load-balancer model config must be an algorithm name or detailed config object"
TOP_LEVEL_KEYS = ("default", "request_algorithms", "models")
_EMPTY: Mapping[Any, Any] = MappingProxyType({})
_CANONICAL_NAMES = ", ".join(a.value for a in SPECS)


def parse_routing_method(raw: str) -> Algorithm:
    """Header form of an algorithm name: trim, ASCII-lowercase, ``_`` → ``-``, then the alias table."""
    value = raw.strip()
    if not value or not value.isascii() or not value.isprintable():
        raise UnknownRoutingMethod(value)
    algorithm = ALIASES.get(value.lower().replace("_", "-"))
    if algorithm is None:
        raise UnknownRoutingMethod(value)
    return algorithm


@dataclass(frozen=True, eq=False, slots=True)
class ModelConfig:
    """A model's config set: its configured definition and its own header overrides."""

    configured: AlgorithmDefinition
    request_algorithms: Mapping[Algorithm, AlgorithmDefinition] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_algorithms", MappingProxyType(dict(self.request_algorithms)))


@dataclass(frozen=True, eq=False, slots=True)
class LbConfig:
    """The parsed configuration. ``default`` serves models not listed in ``models``."""

    default: AlgorithmDefinition
    request_algorithms: Mapping[Algorithm, AlgorithmDefinition] = field(default_factory=dict)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    is_permissive: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_algorithms", MappingProxyType(dict(self.request_algorithms)))
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    @classmethod
    def permissive(cls) -> LbConfig:
        """No config file: power-of-n by default, every algorithm selectable by header (§2.1)."""
        return cls(
            default=default_definition(Algorithm.POWER_OF_N),
            request_algorithms={a: default_definition(a) for a in SPECS},
            is_permissive=True,
        )

    def resolve(self, model_id: str, requested: str | None) -> AlgorithmDefinition:
        """§2.8: ``requested`` is the raw `x-routing-method` value, None when the header is absent."""
        algorithm = None if requested is None else parse_routing_method(requested)
        return self.resolve_algorithm(model_id, algorithm)

    def resolve_algorithm(self, model_id: str, algorithm: Algorithm | None) -> AlgorithmDefinition:
        """§2.8 for an already parsed header (the proxy checks the header's syntax earlier)."""
        model = self.models.get(model_id)
        configured = model.configured if model is not None else self.default
        if algorithm is None or configured.algorithm is algorithm:
            return configured
        if model is not None and algorithm in model.request_algorithms:
            return model.request_algorithms[algorithm]
        if algorithm in self.request_algorithms:
            return self.request_algorithms[algorithm]
        raise UnavailableRoutingMethod(algorithm, model_id)

    def definitions(self) -> tuple[AlgorithmDefinition, ...]:
        """Every distinct definition, once each: what the router instantiates at startup."""
        found: dict[int, AlgorithmDefinition] = {}
        for definition in (self.default, *self.request_algorithms.values()):
            found.setdefault(id(definition), definition)
        for model in self.models.values():
            for definition in (model.configured, *model.request_algorithms.values()):
                found.setdefault(id(definition), definition)
        return tuple(found.values())

    def summary(self) -> str:
        """A short human description: default, request algorithms, per-model algorithms."""
        lines = [f"default: {describe_definition(self.default)}"]
        lines.append(f"request algorithms: {_describe_overrides(self.request_algorithms)}")
        if not self.models:
            lines.append("models: none listed")
        else:
            lines.append("models:")
        for model_id, model in self.models.items():
            name = json.dumps(model_id, ensure_ascii=False)
            lines.append(f"  {name}: {describe_definition(model.configured)}")
            if model.request_algorithms:
                lines.append(f"    request algorithms: {_describe_overrides(model.request_algorithms)}")
        return "\n".join(lines)


def describe_definition(definition: AlgorithmDefinition) -> str:
    """``name (field=value, ...)`` listing the comparator and every non-default setting by JSON name."""
    baseline = default_definition(definition.algorithm)
    parts = [f"comparator={definition.comparator.value}"] if definition.comparator is not None else []
    for name in _SUMMARY_FIELDS:
        value = getattr(definition, name)
        if value == getattr(baseline, name):
            continue
        if name == "queue_slo_ms":
            parts += [f"max_queue_time_floor_ms={value[0]}", f"max_queue_time_ceil_ms={value[1]}"]
        elif name == "seed":
            parts.append(f"seed={json.dumps(value, ensure_ascii=False)}")
        else:
            parts.append(f"{_JSON_NAMES.get(name, name)}={_format(value)}")
    return f"{definition.algorithm.value} ({', '.join(parts)})" if parts else definition.algorithm.value


def _describe_overrides(overrides: Mapping[Algorithm, AlgorithmDefinition]) -> str:
    return "; ".join(describe_definition(d) for d in overrides.values()) if overrides else "none"


def _format(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    return str(value)


_JSON_NAMES = {
    "virtual_nodes": "cache_affinity_virtual_nodes",
    "selection_count": "cache_affinity_backend_selection_count",
}
_SUMMARY_FIELDS = tuple(
    f.name for f in dataclass_fields(AlgorithmDefinition) if f.name not in ("algorithm", "comparator")
)


def parse_algorithm_name(value: object, path: str) -> Algorithm:
    """JSON form of an algorithm name: canonical or alias, exact and case-sensitive (§2.3)."""
    if not isinstance(value, str):
        raise ConfigError(f"invalid type: {describe_json(value)}, expected an algorithm name", path=path)
    algorithm = ALIASES.get(value)
    if algorithm is None:
        raise ConfigError(
            f"unknown load-balancer algorithm {json.dumps(value)}, expected one of: {_CANONICAL_NAMES}"
            " (or an alias)",
            path=path,
        )
    return algorithm


def parse_lb_config(data: object) -> LbConfig:
    """Build the configuration from decoded JSON (spec §2.2 to §2.5)."""
    _check_values(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid type: {describe_json(data)}, expected a JSON object", path="$")
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"unknown field {json.dumps(key)}, expected one of: {', '.join(TOP_LEVEL_KEYS)}",
                path=child_path("$", str(key)),
            )
    default_name = data.get("default", Algorithm.POWER_OF_N.value)
    if isinstance(default_name, Mapping):
        raise ConfigError(
            "default must be an algorithm name; to tune settings, list the model under models",
            path="$.default",
        )
    default = default_definition(parse_algorithm_name(default_name, "$.default"))
    overrides = _parse_request_algorithms(data.get("request_algorithms", _EMPTY), "$.request_algorithms", 1)
    models = _parse_models(data.get("models", _EMPTY), "$.models")
    return LbConfig(default=default, request_algorithms=overrides, models=models)


def load_lb_config(path: str) -> LbConfig:
    """Read, decode and parse ``path``; every failure is a ``ConfigError`` naming the file."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"failed to read lb config file: {exc.strerror or exc}", file=path) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"failed to read lb config file: larger than {MAX_CONFIG_BYTES} bytes", file=path)
    try:
        text = raw.decode("utf-8")
        data = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_unique_keys,
        )
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"failed to parse lb config file: {exc}", file=path) from None
    try:
        return parse_lb_config(data)
    except ConfigError as exc:
        raise exc.in_file(path) from None


@dataclass(frozen=True, slots=True)
class _Invalid:
    """A value the decoder refused; it stands in the tree so that the error can name its JSON path."""

    reason: str


# An integer literal longer than this is out of any field's range without converting it (Python
# refuses to convert more than 4300 digits).
_MAX_INTEGER_DIGITS = len(str(int(sys.float_info.max)))


def _reject_constant(name: str) -> _Invalid:
    return _Invalid(f"{name} is not a valid JSON number")


def _parse_float(text: str) -> float | _Invalid:
    value = float(text)
    return _out_of_range(text) if math.isinf(value) else value


def _parse_int(text: str) -> int | _Invalid:
    """Number fields take integers as 64-bit floats, so one beyond their range fits no field."""
    if len(text.lstrip("-")) > _MAX_INTEGER_DIGITS:
        return _out_of_range(text)
    value = int(text)
    return _out_of_range(text) if abs(value) > sys.float_info.max else value


def _out_of_range(text: str) -> _Invalid:
    shown = text if len(text) <= 32 else f"{text[:12]}...{text[-12:]} ({len(text)} characters)"
    return _Invalid(f"number {shown} is out of range: its magnitude exceeds the largest finite 64-bit float")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Invalid:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            return _Invalid(f"duplicate key {json.dumps(key)} in a JSON object")
        result[key] = value
    return result


def _check_values(data: object) -> None:
    """Report what the decoder refused, and keys and strings that are not valid Unicode.

    A ``\\ud800`` escape is valid JSON but decodes to a lone surrogate, which no UTF-8 output (the
    summary, logs, the affinity ring's hashes) can carry. Iterative: decoded JSON may nest deeply.
    """
    stack: list[tuple[str, object]] = [("$", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Invalid):
            raise ConfigError(value.reason, path=path)
        if isinstance(value, str):
            _check_unicode(value, "string", path)
        elif isinstance(value, Mapping):
            children: list[tuple[str, object]] = []
            for key, item in value.items():
                if isinstance(key, str):
                    _check_unicode(key, "key", f"{path}[{json.dumps(key)}]")
                children.append((child_path(path, str(key)), item))
            stack.extend(reversed(children))
        elif isinstance(value, list | tuple):
            stack.extend(reversed([(f"{path}[{index}]", item) for index, item in enumerate(value)]))


def _check_unicode(text: str, what: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = ord(text[exc.start])
        raise ConfigError(
            f"{what} is not valid Unicode: it holds the lone surrogate escape \\u{surrogate:04x}", path=path
        ) from None


def _parse_models(value: object, path: str) -> dict[str, ModelConfig]:
    entries = _expect_object(value, path)
    models: dict[str, ModelConfig] = {}
    for model_id, entry in entries.items():
        entry_path = child_path(path, model_id)
        configured, overrides = _parse_entry(entry, entry_path, 1)
        models[model_id] = ModelConfig(configured=configured, request_algorithms=overrides)
    return models


def _parse_request_algorithms(value: object, path: str, depth: int) -> dict[Algorithm, AlgorithmDefinition]:
    if depth > MAX_NESTING:
        raise ConfigError(f"request_algorithms nested more than {MAX_NESTING} levels deep", path=path)
    entries = _expect_object(value, path)
    result: dict[Algorithm, AlgorithmDefinition] = {}
    seen: dict[Algorithm, str] = {}
    for key, entry in entries.items():
        entry_path = child_path(path, key)
        algorithm = parse_algorithm_name(key, entry_path)
        if algorithm in seen:
            raise ConfigError(
                f"request_algorithms lists {algorithm.value} more than once "
                f"({json.dumps(seen[algorithm])} and {json.dumps(key)})",
                path=entry_path,
            )
        seen[algorithm] = key
        # Only entries directly under `models` honour their own request_algorithms (§2.4): a map
        # nested here is validated like any other and then dropped.
        definition, _ignored = _parse_entry(entry, entry_path, depth + 1)
        if definition.algorithm is not algorithm:
            raise ConfigError(
                f"request_algorithms key {algorithm.value} does not match configured algorithm "
                f"{definition.algorithm.value}",
                path=entry_path,
            )
        result[algorithm] = definition
    return result


def _parse_entry(
    value: object, path: str, depth: int
) -> tuple[AlgorithmDefinition, dict[Algorithm, AlgorithmDefinition]]:
    """An entry is an algorithm name or a detailed object; returns it with its own overrides."""
    if isinstance(value, str):
        return default_definition(parse_algorithm_name(value, path)), {}
    if not isinstance(value, Mapping):
        raise ConfigError(ENTRY_TYPE_ERROR, path=path)
    if "algorithm" not in value:
        raise ConfigError("missing field `algorithm`", path=path)
    algorithm = parse_algorithm_name(value["algorithm"], child_path(path, "algorithm"))
    fields = {k: v for k, v in value.items() if k not in ("algorithm", "request_algorithms")}
    overrides: dict[Algorithm, AlgorithmDefinition] = {}
    if "request_algorithms" in value:
        overrides = _parse_request_algorithms(
            value["request_algorithms"], child_path(path, "request_algorithms"), depth
        )
    parsed = parse_fields(algorithm, SPECS[algorithm].fields, fields, path)
    definition = normalise(algorithm, parsed, default_comparator(algorithm))
    check_definition(definition, path)
    return definition, overrides


def _expect_object(value: object, path: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"invalid type: {describe_json(value)}, expected a JSON object", path=path)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"object keys must be strings, got {describe_json(key)}", path=path)
    return value
