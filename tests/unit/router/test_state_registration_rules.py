"""Registration rules and watch normalisation (spec §5.3-§5.7; conformance 82, 128-133, 137)."""

from __future__ import annotations

import pytest

from stargate.balancer.types import ModelStats
from stargate.proto import stargate_pb2 as pb
from stargate.router import watch
from stargate.router.registration import (
    Identity,
    RegistrationRejected,
    admit_first,
    bearer_token,
    check_identity,
    convert_stats,
    idle_timeout_ms,
    model_updates,
    validate_url,
)

URL_PREFIX = "invalid inference_server_url: inference_server_url "


def registration(**fields: object) -> pb.InferenceServerRegistration:
    values: dict[str, object] = {"inference_server_id": "srv", "inference_server_url": "http://10.0.0.1:8080"}
    values.update(fields)
    return pb.InferenceServerRegistration(**values)  # type: ignore[arg-type]


def rejection(message: pb.InferenceServerRegistration) -> str:
    with pytest.raises(RegistrationRejected) as info:
        admit_first(message, reverse_listener=False)
    return info.value.message


def test_128_empty_id_then_empty_url() -> None:
    both_empty = registration(inference_server_id="", inference_server_url="")
    assert rejection(both_empty) == "inference_server_id is empty"
    assert rejection(registration(inference_server_url="")) == "inference_server_url is empty"


@pytest.mark.parametrize(
    ("url", "detail"),
    [
        ("not a url", "must be a valid URL"),
        ("10.0.0.1:8080", "must be a valid URL"),
        ("localhost:8080", "scheme must be http or https"),
        ("http://10.0.0.1:99999", "must be a valid URL"),
        ("http://10.0.0.1:port", "must be a valid URL"),
        ("quic://10.0.0.1:8080", "scheme must be http or https"),
        ("ftp://host:21", "scheme must be http or https"),
        ("http://:8080", "must include host"),
        ("http:///path", "must include host"),
    ],
)
def test_129_direct_url_validation_order(url: str, detail: str) -> None:
    assert rejection(registration(inference_server_url=url)) == URL_PREFIX + detail


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [
        ("http://10.0.0.1:8080", "10.0.0.1", 8080),
        ("https://backend.default.svc", "backend.default.svc", 443),
        ("http://pylon-0.local", "pylon-0.local", 80),
        ("http://[::1]:9001", "::1", 9001),
    ],
)
def test_direct_mode_accepts_http_with_any_host(url: str, host: str, port: int) -> None:
    assert validate_url(url) == (host, port)
    identity = admit_first(registration(inference_server_url=url), reverse_listener=False)
    assert identity.inference_server_url == url


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"inference_server_id": "pylon-\u00e9"}, "inference_server_id"),
        ({"inference_server_id": " pylon"}, "inference_server_id"),
        ({"inference_server_url": "http://h\u00e9st:80"}, "inference_server_url"),
        ({"cluster_id": "c\x01"}, "cluster_id"),
    ],
)
def test_identity_that_no_response_header_can_carry_is_rejected(fields: dict[str, str], name: str) -> None:
    assert rejection(registration(**fields)) == f"{name} must be visible ASCII without surrounding spaces"


def test_130_reverse_flag_without_listener_is_rejected_after_url_checks() -> None:
    message = registration(reverse_tunnel=True, inference_server_url="http://backend.default.svc:8080")
    assert rejection(message) == "reverse tunnel flag set but no reverse tunnel config"
    assert rejection(registration(reverse_tunnel=True, inference_server_url="quic://x:1")).startswith(URL_PREFIX)
    assert admit_first(message, reverse_listener=True).reverse_tunnel


def test_132_empty_cluster_id_is_the_server_id() -> None:
    assert admit_first(registration(), reverse_listener=False).cluster_id == "srv"
    assert admit_first(registration(cluster_id="rack-1"), reverse_listener=False).cluster_id == "rack-1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reverse_tunnel": True, "inference_server_url": "http://x:1", "inference_server_id": "y"},
         "reverse tunnel flag changed"),
        ({"inference_server_url": "http://10.0.0.2:8080", "inference_server_id": "other"},
         "inference_server_url changed"),
        ({"inference_server_id": "other", "cluster_id": "srv"}, "inference_server_id changed"),
        ({"cluster_id": "rack-2"}, "cluster_id changed"),
    ],
)
def test_131_identity_changes_in_check_order(change: dict[str, object], message: str) -> None:
    identity = admit_first(registration(), reverse_listener=False)
    with pytest.raises(RegistrationRejected, match=f"^{message}$"):
        check_identity(identity, registration(**change))


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("inference_server_id", "i" * 513, 512),
        ("cluster_id", "c" * 513, 512),
        ("inference_server_url", "http://x:1/" + "p" * 2038, 2048),
    ],
)
def test_over_long_identities_are_refused(field: str, value: str, limit: int) -> None:
    """A megabyte id made every health probe fail (header too long) and every log line a megabyte."""
    with pytest.raises(RegistrationRejected, match=f"^{field} is longer than {limit} characters$"):
        admit_first(registration(**{field: value}), reverse_listener=False)
    admit_first(registration(**{field: value[:-1]}), reverse_listener=False)


def test_explicit_cluster_equal_to_id_is_not_a_change() -> None:
    identity = Identity("srv", "http://10.0.0.1:8080", False, "srv")
    check_identity(identity, registration(cluster_id="srv"))


@pytest.mark.parametrize(
    ("heartbeat", "floor", "cap", "expected"),
    [
        ("120000", 60_000, 600_000, 360_000),
        ("1000", 60_000, 300_000, 60_000),
        ("0", 60_000, 300_000, 60_000),
        ("120000", 60_000, 300_000, 300_000),
        ("1000", 60_000, 10_000, 10_000),
        (None, 60_000, 300_000, 300_000),
        ("abc", 60_000, 300_000, 300_000),
        ("-5", 60_000, 300_000, 300_000),
        ("12é", 60_000, 300_000, 300_000),
        (b"1000", 60_000, 300_000, 300_000),
        (str(2**64), 60_000, 300_000, 300_000),
        (str(2**64 - 1), 60_000, 2**64 - 1, 2**64 - 1),
        ("1000", 0, 300_000, None),
        ("1000", 60_000, 0, None),
    ],
)
def test_133_idle_timeout_negotiation(
    heartbeat: str | bytes | None, floor: int, cap: int, expected: int | None
) -> None:
    assert idle_timeout_ms(heartbeat, floor, cap) == expected


def test_bearer_token_needs_the_exact_prefix() -> None:
    assert bearer_token([("authorization", "Bearer tok en")]) == "tok en"
    assert bearer_token([("authorization", "bearer tok")]) is None
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("x-other", "Bearer tok")]) is None


def test_82_active_entry_without_stats_is_inactive() -> None:
    message = registration()
    message.models["with-stats"].status = pb.INFERENCE_SERVER_STATUS_ACTIVE
    message.models["with-stats"].stats.queue_size = 3
    message.models["no-stats"].status = pb.INFERENCE_SERVER_STATUS_ACTIVE
    message.models["inactive"].status = pb.INFERENCE_SERVER_STATUS_INACTIVE
    message.models["inactive"].stats.queue_size = 1
    message.models["unknown-enum"].status = 7  # type: ignore[assignment]
    message.models["unknown-enum"].stats.queue_size = 1
    updates = model_updates(message, max_models=10)
    assert updates == {
        "with-stats": ModelStats(queue_size=3),
        "no-stats": None,
        "inactive": None,
        "unknown-enum": None,
    }
    with pytest.raises(RegistrationRejected, match="too many models in one registration: 4 \\(limit 3\\)"):
        model_updates(message, max_models=3)


@pytest.mark.parametrize(
    ("model_id", "error"),
    [
        ("", "model id is empty"),
        ("  padded  ", "model id must be visible ASCII without surrounding spaces"),
        ("\x00nul", "model id must be visible ASCII without surrounding spaces"),
        ("a\nb", "model id must be visible ASCII without surrounding spaces"),
        ("mod\u00e8le", "model id must be visible ASCII without surrounding spaces"),
        ("m" * 513, "model id is longer than 512 characters"),
    ],
)
def test_model_ids_no_request_can_name_are_refused(model_id: str, error: str) -> None:
    """Each was listed and labelled; 300 updates naming a new 256 KB id each grew a scrape to 77 MB."""
    message = registration()
    message.models["ok"].status = pb.INFERENCE_SERVER_STATUS_ACTIVE
    message.models[model_id].status = pb.INFERENCE_SERVER_STATUS_ACTIVE
    with pytest.raises(RegistrationRejected, match=f"^{error}$"):
        model_updates(message, max_models=10)
    assert set(model_updates(registration(models={"m" * 512: {}, "a b\tc": {}}), max_models=10)) == {
        "m" * 512,
        "a b\tc",
    }


def test_convert_stats_copies_every_field() -> None:
    expected = ModelStats(
        last_mean_input_tps=1.5,
        output_tps=2.5,
        queue_size=3,
        queued_input_size=4,
        max_output_tps=5.5,
        kv_cache_capacity_tokens=6,
        kv_cache_used_tokens=7,
        kv_cache_free_tokens=8,
        num_running_queries=9,
        max_engine_concurrency=10,
        total_query_input_size=11,
        queue_time_estimate_ms_by_priority={4: 40, 1: 10},
        input_processing_queries=13,
        output_generation_queries=14,
        stats_observed_at_unix_ms=15,
        stats_capabilities=("a", "b"),
        stats_sources=("s",),
    )
    wire = pb.ModelStats(**{f: getattr(expected, f) for f in expected.__slots__})
    stats = convert_stats(wire)
    assert stats == expected
    assert list(stats.queue_time_estimate_ms_by_priority.items()) == [(1, 10), (4, 40)]


def test_137_watch_entries_and_urls_are_deduplicated_sorted_and_exclude_self() -> None:
    entries = [
        watch.StargateEntry("", "10.0.0.2:50071"),
        watch.StargateEntry("sg-b", "10.0.0.2:50071", "10.0.0.2:8000"),
        watch.StargateEntry("sg-a", "10.0.0.1:50071"),
        watch.StargateEntry("sg-a", "10.0.0.9:50071"),
        watch.StargateEntry("", "10.0.0.3:50071"),
    ]
    normalised = watch.normalize_stargates(entries, " dial:1 ")
    assert [(e.stargate_id, e.advertise_addr) for e in normalised] == [
        ("", "10.0.0.3:50071"),
        ("sg-a", "10.0.0.1:50071"),
        ("sg-b", "10.0.0.2:50071"),
    ]
    assert {e.grpc_pylon_dial_addr for e in normalised} == {"dial:1"}
    assert watch.normalize_stargates(entries[:1], "  ")[0].grpc_pylon_dial_addr == ""

    exclude = watch.self_endpoint_keys("10.0.0.1:50071", "stargate-headless.ns.svc", 50071)
    urls = watch.normalize_watch_urls(
        [
            " http://remote-b:50071 ",
            "",
            "remote-a:50071",
            "HTTP://Remote-B:50071/",
            "http://10.0.0.1:50071",
            "stargate-headless.ns.svc:50071",
            "http://stargate.ns.svc:50071",
            "https://remote-c",
        ],
        exclude,
    )
    assert urls == ["remote-a:50071", "http://remote-b:50071", "https://remote-c"]
    with pytest.raises(ValueError):
        watch.normalize_watch_urls(["grpc://nohost-default-port"], set())
