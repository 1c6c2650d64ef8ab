"""lb-config parsing, normalisation and resolution: spec §2 and conformance §8.1 (1-20)."""

from __future__ import annotations

import math
from dataclasses import astuple
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stargate.balancer.config import (
    LbConfig,
    UnavailableRoutingMethod,
    UnknownRoutingMethod,
    load_lb_config,
    parse_lb_config,
    parse_routing_method,
)
from stargate.balancer.config_schema import Fields
from stargate.balancer.registry import ALIASES, SPECS
from stargate.balancer.settings import Algorithm, Comparator
from stargate.errors import ConfigError

FIELD_WORDS = sorted(
    {"algorithm", "request_algorithms", "unknown", *ALIASES, *(c.value for c in Comparator)}
    | {name for spec in SPECS.values() for name in spec.fields.model_fields}
)


def model(entry: object, model_id: str = "model-a") -> Any:
    """Parse a config holding one model entry and return its configured definition."""
    return parse_lb_config({"models": {model_id: entry}}).resolve(model_id, None)


def config_error(data: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_lb_config(data)
    return info.value


def test_c01_permissive_default_uses_power_of_n_and_offers_every_algorithm() -> None:
    config = LbConfig.permissive()
    assert config.resolve("any", None).algorithm is Algorithm.POWER_OF_N
    pulsar = config.resolve("any", "pulsar")
    assert pulsar.algorithm is Algorithm.PULSAR
    assert pulsar.seed == "" and not pulsar.consider_kv_free_tokens
    assert {config.resolve("m", a.value).algorithm for a in Algorithm} == set(Algorithm)


def test_c02_unknown_default_algorithm_names_the_value() -> None:
    error = config_error({"default": "not-a-real-lb"})
    assert "not-a-real-lb" in error.reason
    assert error.path == "$.default"


def test_c03_unknown_top_level_key_is_rejected_by_name() -> None:
    error = config_error({"unused_top_level_field": 1})
    assert "unused_top_level_field" in error.reason
    assert error.path == "$.unused_top_level_field"


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"algorithm": "round-robin", "seed": "x"}, "seed"),
        ({"algorithm": "pulsar", "max_queue_time_floor_ms": 1}, "max_queue_time_floor_ms"),
        ({"algorithm": "wait-and-widen", "consider_kv_free_tokens": True}, "consider_kv_free_tokens"),
        ({"algorithm": "random", "sample_count": 2}, "sample_count"),
        ({"algorithm": "random", "comparator": "ttft"}, "comparator"),
    ],
)
def test_c04_unsupported_fields_are_named(entry: dict[str, object], field: str) -> None:
    error = config_error({"models": {"model-a": entry}})
    assert field in error.reason
    assert error.path == '$.models["model-a"]'


def test_c04_unsupported_fields_message_lists_keys_sorted() -> None:
    error = config_error({"models": {"m": {"algorithm": "round-robin", "seed": "x", "n": 1}}})
    assert error.reason == "round-robin config does not support field(s): n, seed"


@pytest.mark.parametrize("count", [0, 65, -1])
def test_c05_sample_count_out_of_range(count: int) -> None:
    error = config_error({"models": {"model-a": {"algorithm": "power-of-n", "sample_count": count}}})
    assert error.reason == f"power-of-n sample_count must be between 1 and 64, got {count}"
    assert error.path == '$.models["model-a"].sample_count'


def test_c05_sample_count_default_and_bounds() -> None:
    assert model({"algorithm": "power-of-n"}).sample_count == 2
    assert model({"algorithm": "power-of-n", "sample_count": 1}).sample_count == 1
    assert model({"algorithm": "power-of-n", "sample_count": 64}).sample_count == 64


def test_c05_sample_count_null_and_float_are_type_errors() -> None:
    for value in (None, 2.0, True):
        error = config_error({"models": {"m": {"algorithm": "power-of-n", "sample_count": value}}})
        assert error.reason.startswith("invalid type:")


def test_c06_comparator_rejected_for_pulsar_wait_and_widen() -> None:
    error = config_error({"models": {"m": {"algorithm": "pulsar-wait-and-widen", "comparator": "ttft"}}})
    assert error.reason == "comparator is not supported for pulsar-wait-and-widen"
    assert error.path == "$.models.m.comparator"


@pytest.mark.parametrize("algorithm", ["power-of-n", "wait-and-widen", "pulsar-wait-and-widen"])
def test_c06_comparator_null_is_a_type_error(algorithm: str) -> None:
    error = config_error({"models": {"m": {"algorithm": algorithm, "comparator": None}}})
    assert "invalid type: null" in error.reason


def test_c07_request_algorithms_key_must_match_value() -> None:
    error = config_error({"request_algorithms": {"random": "round-robin"}})
    assert error.reason == "request_algorithms key random does not match configured algorithm round-robin"
    assert error.path == "$.request_algorithms.random"


def test_c07_mismatch_uses_canonical_names() -> None:
    error = config_error({"request_algorithms": {"powerOf2": {"algorithm": "groq-multiregion"}}})
    assert "key power-of-n does not match configured algorithm wait-and-widen" in error.reason


def test_c08_aliases_in_default_models_and_header() -> None:
    config = parse_lb_config({"default": "groq-multiregion", "models": {"m": "pulsar-multiregion"}})
    assert config.default.algorithm is Algorithm.WAIT_AND_WIDEN
    assert config.resolve("m", None).algorithm is Algorithm.PULSAR_WAIT_AND_WIDEN
    assert parse_routing_method("groq_multiregion") is Algorithm.WAIT_AND_WIDEN
    assert config.resolve("other", "groq_multiregion") is config.default


def test_c08_json_aliases_are_case_sensitive() -> None:
    assert model("powerOf2").algorithm is Algorithm.POWER_OF_N
    assert "POWEROF2" in config_error({"default": "POWEROF2"}).reason


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("power_of_two", Algorithm.POWER_OF_N),
        ("round_robin", Algorithm.ROUND_ROBIN),
        ("pulsar_multiregion", Algorithm.PULSAR_WAIT_AND_WIDEN),
        ("  GROQ_MULTIREGION ", Algorithm.WAIT_AND_WIDEN),
        ("PowerOf2", Algorithm.POWER_OF_N),
    ],
)
def test_c09_header_aliases_under_permissive_default(header: str, expected: Algorithm) -> None:
    assert LbConfig.permissive().resolve("m", header).algorithm is expected


@pytest.mark.parametrize("header", ["", "   ", "sticky", "pulsar\u00e9", "round robin"])
def test_c10_blank_invalid_or_unknown_header_is_400(header: str) -> None:
    with pytest.raises(UnknownRoutingMethod) as info:
        LbConfig.permissive().resolve("m", header)
    assert info.value.status == 400


def test_c11_explicit_config_restricts_overrides() -> None:
    config = parse_lb_config({"request_algorithms": {"round-robin": "round-robin"}})
    assert config.resolve("m", "round-robin").algorithm is Algorithm.ROUND_ROBIN
    with pytest.raises(UnavailableRoutingMethod) as info:
        config.resolve("m", "pulsar")
    assert info.value.status == 400
    assert info.value.algorithm is Algorithm.PULSAR


def test_c12_matching_override_returns_the_configured_definition() -> None:
    config = parse_lb_config(
        {
            "request_algorithms": {"round-robin": "round-robin"},
            "models": {"model-a": {"algorithm": "round-robin", "require_input_tokens": True}},
        }
    )
    configured = config.resolve("model-a", None)
    assert configured.require_input_tokens
    assert config.resolve("model-a", "round-robin") is configured
    assert config.resolve("model-a", "ROUND_ROBIN") is configured
    assert config.resolve("model-b", "round-robin") is config.request_algorithms[Algorithm.ROUND_ROBIN]


def test_c13_configured_algorithm_wins_over_top_level_override() -> None:
    config = parse_lb_config(
        {
            "default": "random",
            "request_algorithms": {"power-of-n": {"algorithm": "power-of-n", "sample_count": 4}},
            "models": {
                "model-a": {
                    "algorithm": "power-of-n",
                    "sample_count": 8,
                    "request_algorithms": {"power-of-n": {"algorithm": "power-of-n", "sample_count": 64}},
                }
            },
        }
    )
    assert config.resolve("model-a", "power-of-n").sample_count == 8
    assert config.resolve("model-b", "power-of-n").sample_count == 4
    assert config.resolve("model-b", None).algorithm is Algorithm.RANDOM


def test_c14_model_request_algorithms_apply_to_that_model_only() -> None:
    config = parse_lb_config(
        {
            "request_algorithms": {"round-robin": "round-robin"},
            "models": {
                "model-a": {
                    "algorithm": "random",
                    "request_algorithms": {
                        "round-robin": {"algorithm": "round-robin", "require_input_tokens": True}
                    },
                }
            },
        }
    )
    assert config.resolve("model-a", "round-robin").require_input_tokens
    assert not config.resolve("model-b", "round-robin").require_input_tokens
    with pytest.raises(UnavailableRoutingMethod):
        config.resolve("model-a", "pulsar")


def test_c14_model_set_falls_back_to_top_level_overrides() -> None:
    config = parse_lb_config({"request_algorithms": {"pulsar": "pulsar"}, "models": {"m": "random"}})
    assert config.resolve("m", "pulsar") is config.request_algorithms[Algorithm.PULSAR]


def test_c15_wait_and_widen_zero_values_normalise() -> None:
    definition = model(
        {
            "algorithm": "wait-and-widen",
            "cache_affinity_virtual_nodes": 0,
            "cache_affinity_backend_selection_count": 0,
            "n": 0,
        }
    )
    assert definition.virtual_nodes == 1
    assert definition.selection_count is None
    assert definition.n == 1
    assert definition.ttft_bucket_size_ms == 20
    assert definition.next_bucket_unlock_factor == 0.25
    assert definition.max_queued == 0
    assert definition.comparator is Comparator.TTFT


def test_c15_wait_and_widen_null_means_unset_and_explicit_zero_is_kept() -> None:
    nulls = model({"algorithm": "wait-and-widen", "n": None, "seed": None, "ttft_bucket_size_ms": None})
    assert (nulls.n, nulls.seed, nulls.ttft_bucket_size_ms, nulls.virtual_nodes) == (2, "", 20, 150)
    zero = model({"algorithm": "wait-and-widen", "ttft_bucket_size_ms": 0, "next_bucket_unlock_factor": 0})
    assert zero.ttft_bucket_size_ms == 0
    assert zero.next_bucket_unlock_factor == 0.0 and isinstance(zero.next_bucket_unlock_factor, float)


@pytest.mark.parametrize("algorithm", ["wait-and-widen", "pulsar-wait-and-widen"])
def test_every_wait_and_widen_family_field_but_comparator_takes_null_as_unset(algorithm: str) -> None:
    specific = set(SPECS[ALIASES[algorithm]].fields.model_fields) - set(Fields.model_fields) - {"comparator"}
    default = astuple(model({"algorithm": algorithm}))
    for name in sorted(specific):
        assert astuple(model({"algorithm": algorithm, name: None})) == default, name


def test_consider_kv_free_tokens_null_stays_a_type_error_on_pulsar() -> None:
    error = config_error({"models": {"m": {"algorithm": "pulsar", "consider_kv_free_tokens": None}}})
    assert error.path == "$.models.m.consider_kv_free_tokens" and "invalid type: null" in error.reason


def test_c15_queue_slo_needs_both_bounds_and_is_not_reordered() -> None:
    assert model({"algorithm": "wait-and-widen", "max_queue_time_floor_ms": 100}).queue_slo_ms is None
    both = model(
        {"algorithm": "wait-and-widen", "max_queue_time_floor_ms": 300, "max_queue_time_ceil_ms": 100}
    )
    assert both.queue_slo_ms == (300, 100)


def test_c15_integer_fields_reject_floats_and_f64_fields_accept_ints() -> None:
    error = config_error({"models": {"m": {"algorithm": "wait-and-widen", "n": 2.0}}})
    assert error.path == "$.models.m.n" and "floating point" in error.reason
    assert model({"algorithm": "random", "max_input_work_seconds": 3}).max_input_work_seconds == 3.0
    error = config_error({"models": {"m": {"algorithm": "wait-and-widen", "max_queued": -1}}})
    assert error.path == "$.models.m.max_queued"


def test_c16_model_entry_of_wrong_type() -> None:
    for entry in (5, None, ["random"], True):
        error = config_error({"models": {"model-a": entry}})
        assert (
            error.reason == "load-balancer model config must be an algorithm name or detailed config object"
        )


def test_c17_nested_request_algorithms_in_an_override_are_ignored() -> None:
    config = parse_lb_config(
        {
            "request_algorithms": {
                "random": {"algorithm": "random", "request_algorithms": {"pulsar": "pulsar"}}
            }
        }
    )
    assert config.resolve("m", "random").algorithm is Algorithm.RANDOM
    with pytest.raises(UnavailableRoutingMethod):
        config.resolve("m", "pulsar")


@pytest.mark.parametrize("scale", [1.5, -0.1, math.nan])
def test_c18_scale_outside_unit_interval_fails(scale: float) -> None:
    error = config_error(
        {"models": {"m": {"algorithm": "wait-and-widen", "cache_affinity_input_tokens_scale": scale}}}
    )
    assert error.path == "$.models.m.cache_affinity_input_tokens_scale"


def test_c18_scale_bounds_accepted() -> None:
    for scale, expected in ((0.0, 0.0), (1.0, 1.0), (0, 0.0), (1, 1.0)):
        entry = {"algorithm": "wait-and-widen", "cache_affinity_input_tokens_scale": scale}
        assert model(entry).cache_affinity_input_tokens_scale == expected


@pytest.mark.parametrize(
    "field", [{"cache_affinity_wait_ms": 100}, {"cache_affinity_input_tokens_scale": 0.5}]
)
def test_c19_pulsar_wait_and_widen_rejects_non_default_affinity_settings(field: dict[str, object]) -> None:
    error = config_error({"models": {"m": {"algorithm": "pulsar-wait-and-widen", **field}}})
    assert "pulsar-wait-and-widen" in error.reason


def test_c19_pulsar_wait_and_widen_accepts_defaults_explicitly() -> None:
    definition = model(
        {
            "algorithm": "pulsar-multiregion",
            "cache_affinity_wait_ms": 0,
            "cache_affinity_input_tokens_scale": 1.0,
        }
    )
    assert definition.algorithm is Algorithm.PULSAR_WAIT_AND_WIDEN
    assert definition.comparator is None


@pytest.mark.parametrize("algorithm", ["power-of-n", "round-robin", "random", "pulsar"])
def test_c20_affinity_wait_is_unsupported_outside_wait_and_widen(algorithm: str) -> None:
    error = config_error({"models": {"m": {"algorithm": algorithm, "cache_affinity_wait_ms": 200}}})
    assert error.reason == f"{algorithm} config does not support field(s): cache_affinity_wait_ms"


def test_seed_example_wait_and_widen_with_x_200_ms() -> None:
    definition = model(
        {
            "algorithm": "wait-and-widen",
            "cache_affinity_backend_selection_count": 2,
            "cache_affinity_wait_ms": 200,
            "cache_affinity_input_tokens_scale": 0.1,
        }
    )
    assert (definition.selection_count, definition.cache_affinity_wait_ms) == (2, 200)
    assert definition.cache_affinity_input_tokens_scale == 0.1


def test_comparators_resolve_per_algorithm() -> None:
    assert model("power-of-n").comparator is Comparator.TTFT
    assert (
        model({"algorithm": "wait-and-widen", "comparator": "queue-time"}).comparator is Comparator.QUEUE_TIME
    )
    for name in ("round-robin", "random", "pulsar", "pulsar-wait-and-widen"):
        assert model(name).comparator is None
    error = config_error({"models": {"m": {"algorithm": "power-of-n", "comparator": "fastest"}}})
    assert "fastest" in error.reason and error.path == "$.models.m.comparator"


def test_consider_kv_free_tokens_implies_require_input_tokens() -> None:
    definition = model({"algorithm": "pulsar", "consider_kv_free_tokens": True, "seed": "s"})
    assert definition.consider_kv_free_tokens and definition.require_input_tokens
    assert definition.seed == "s"


def test_resolution_returns_the_same_object_every_time() -> None:
    config = parse_lb_config({"models": {"m": {"algorithm": "round-robin"}}})
    assert config.resolve("m", None) is config.resolve("m", None) is config.resolve("m", "round_robin")
    assert config.resolve("x", None) is config.default
    permissive = LbConfig.permissive()
    assert permissive.resolve("a", "pulsar") is permissive.resolve("b", "PULSAR")
    assert len(config.definitions()) == 2


def test_top_level_shapes() -> None:
    assert config_error([]).path == "$"
    assert config_error({"default": {"algorithm": "random"}}).path == "$.default"
    assert config_error({"models": []}).path == "$.models"
    assert config_error({"request_algorithms": {"sticky": "random"}}).path == "$.request_algorithms.sticky"
    assert config_error({"models": {"m": {"sample_count": 2}}}).reason == "missing field `algorithm`"


def test_duplicate_algorithm_after_alias_resolution_is_rejected() -> None:
    error = config_error({"request_algorithms": {"power-of-n": "power-of-n", "powerOf2": "power-of-n"}})
    assert "more than once" in error.reason


def test_config_is_immutable() -> None:
    config = parse_lb_config({"request_algorithms": {"random": "random"}})
    with pytest.raises(TypeError):
        config.request_algorithms[Algorithm.PULSAR] = config.default  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.default = config.default  # type: ignore[misc]


def test_load_lb_config_names_the_file(tmp_path: Any) -> None:
    path = tmp_path / "lb.json"
    path.write_text('{"models": {"model-a": {"algorithm": "power-of-n", "sample_count": 65}}}')
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(path))
    assert info.value.describe() == (
        f'{path}: $.models["model-a"].sample_count: power-of-n sample_count must be between 1 and 64, got 65'
    )


@pytest.mark.parametrize("text", ["{", "\udcff"])
def test_load_lb_config_rejects_invalid_json(tmp_path: Any, text: str) -> None:
    path = tmp_path / "lb.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(path))
    assert info.value.file == str(path)
    assert info.value.reason.startswith("failed to parse lb config file")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        (r'{"models": {"llama": {"algorithm": "pulsar", "seed": "\udc00"}}}', "$.models.llama.seed: string"),
        (r'{"models": {"m\ud800": "random"}}', r'$.models["m\ud800"]: key'),
        (r'{"models": {"m": {"algorithm": "random", "\udfff": 1}}}', r'$.models.m["\udfff"]: key'),
        (r'{"request_algorithms": {"random": {"x": ["a", "\ud83d"]}}}', "random.x[1]: string"),
    ],
)
def test_a_lone_surrogate_escape_is_rejected_with_its_path(tmp_path: Any, text: str, where: str) -> None:
    path = tmp_path / "lb.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(path))
    assert where + " is not valid Unicode: it holds the lone surrogate escape \\u" in info.value.describe()
    info.value.describe().encode("utf-8")


OUT_OF_RANGE = "is out of range: its magnitude exceeds the largest finite 64-bit float"


@pytest.mark.parametrize(
    ("text", "path", "reason"),
    [
        ('{"default": "random", "default": "pulsar"}', "$", 'duplicate key "default" in a JSON object'),
        (
            '{\n "models": {\n  "a": "random",\n  "b": {"algorithm": "random", "n": 2, "n": 3}\n }\n}',
            "$.models.b",
            'duplicate key "n" in a JSON object',
        ),
        ('{"default": NaN}', "$.default", "NaN is not a valid JSON number"),
        (
            '{"models": {"b": {"algorithm": "wait-and-widen", "next_bucket_unlock_factor": -Infinity}}}',
            "$.models.b.next_bucket_unlock_factor",
            "-Infinity is not a valid JSON number",
        ),
        (
            '{"models": {"b": {"algorithm": "power-of-n", "sample_count": 1%s}}}' % ("0" * 5000),
            "$.models.b.sample_count",
            f"number 100000000000...000000000000 (5001 characters) {OUT_OF_RANGE}",
        ),
        (
            '{"models": {"b": {"algorithm": "power-of-n", "max_input_work_seconds": 1%s}}}' % ("0" * 400),
            "$.models.b.max_input_work_seconds",
            f"number 100000000000...000000000000 (401 characters) {OUT_OF_RANGE}",
        ),
        (
            '{"models": {"b": {"algorithm": "wait-and-widen", "n": 1e400}}}',
            "$.models.b.n",
            f"number 1e400 {OUT_OF_RANGE}",
        ),
    ],
)
def test_values_json_refuses_are_reported_with_their_path(
    tmp_path: Any, text: str, path: str, reason: str
) -> None:
    file = tmp_path / "lb.json"
    file.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(file))
    assert (info.value.file, info.value.path, info.value.reason) == (str(file), path, reason)


def test_an_integer_within_the_float_range_is_a_number() -> None:
    entry = {"algorithm": "power-of-n", "max_input_work_seconds": 10**308}
    assert model(entry).max_input_work_seconds == 1e308


def test_load_lb_config_missing_file(tmp_path: Any) -> None:
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(tmp_path / "absent.json"))
    assert info.value.reason.startswith("failed to read lb config file")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from(FIELD_WORDS),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELD_WORDS), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(entry=st.dictionaries(st.sampled_from(FIELD_WORDS), JSON_VALUES, max_size=5))
def test_any_entry_parses_or_raises_config_error(entry: dict[str, object]) -> None:
    try:
        parse_lb_config({"models": {"m": entry}, "request_algorithms": {"random": entry}})
    except ConfigError as error:
        assert error.reason and error.path.startswith("$")


def test_a_number_too_large_for_a_float_is_rejected_not_read_as_infinity(tmp_path: Any) -> None:
    path = tmp_path / "lb.json"
    path.write_text('{"models": {"m": {"algorithm": "power-of-n", "max_input_work_seconds": 1e400}}}')
    with pytest.raises(ConfigError) as info:
        load_lb_config(str(path))
    assert info.value.file == str(path) and "$.models.m.max_input_work_seconds" in str(info.value)
    assert "finite" in info.value.reason
