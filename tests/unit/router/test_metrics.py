"""Metric names, label sets (declared in spec order) and buckets of §6; registries are per instance."""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from stargate.balancer.types import Target
from stargate.router.metrics import (
    DEPARTED_SERIES_TTL_S,
    MAX_CLIENT_LABEL_CHARS,
    MAX_CLIENT_TARGETS,
    OTHER_TARGET,
    RouterMetrics,
)

T = Target("rk", "m")
TGT = ("routing_key", "model")


def test_declared_label_names_follow_the_spec_order() -> None:
    m = RouterMetrics()
    declared = {
        m.requests_total: (*TGT, "inference_server_id", "status"),
        m.proxy_attempts_total: (*TGT, "inference_server_id", "result"),
        m.proxy_retries_total: (*TGT, "reason"),
        m.routing_selections_total: (*TGT, "algorithm", "selection"),
        m.routing_kv_free_token_fallback_selections_total: (*TGT, "algorithm"),
        m.proxy_retry_exhausted_total: (*TGT, "reason"),
        m.admission_rejections_total: (*TGT, "reason"),
        m.quic_connection_evictions_total: ("inference_server_id", "reason"),
        m.quic_hot_path_reconnect_total: ("inference_server_id", "result"),
        m.tls_reloads_total: ("material_type", "result"),
        m.proxy_replay_buffer_bytes: ("model",),
        m.proxy_duration_seconds: (*TGT, "inference_server_id"),
        m.routing_duration_seconds: TGT,
        m.active_inference_servers: TGT,
        m.tls_certificate_expiry_seconds: ("material_type",),
    }
    for metric, labels in declared.items():
        assert metric._labelnames == labels, metric._name


def test_exposed_names_with_prefix() -> None:
    m = RouterMetrics(prefix="x_")
    m.request_finished(T, "b1", 200)
    m.selection(T, "pulsar", 2, True)
    m.eviction("b1", "proxy_error")
    m.reconnect("b1", False)
    get = m.registry.get_sample_value
    assert (
        get(
            "x_requests_total",
            {"routing_key": "rk", "model": "m", "inference_server_id": "b1", "status": "200"},
        )
        == 1
    )
    assert (
        get(
            "x_routing_selections_total",
            {"routing_key": "rk", "model": "m", "algorithm": "pulsar", "selection": "fallback"},
        )
        == 1
    )
    assert (
        get(
            "x_routing_kv_free_token_fallback_selections_total",
            {"routing_key": "rk", "model": "m", "algorithm": "pulsar"},
        )
        == 1
    )
    assert (
        get("x_quic_connection_evictions_total", {"inference_server_id": "b1", "reason": "proxy_error"}) == 1
    )
    assert get("x_quic_hot_path_reconnect_total", {"inference_server_id": "b1", "result": "error"}) == 1
    for result in ("success", "rejected"):
        assert get("x_tls_reloads_total", {"material_type": "server_identity", "result": result}) == 0


def buckets(m: RouterMetrics, name: str) -> list[tuple[str, float]]:
    """Every bucket bound exposed for ``name`` (one series observed) with its count, in order."""
    return [
        (sample.labels["le"], sample.value)
        for family in m.registry.collect()
        for sample in family.samples
        if sample.name == f"{name}_bucket"
    ]


def test_buckets_match_the_spec() -> None:
    """The whole list: a bucket added or dropped changes every dashboard quantile."""
    m = RouterMetrics()
    m.replay_buffer(T, 5000)
    m.proxy_duration(T, "b1", 0.2)
    m.routing_duration(T, 0.0002)
    replay = [0, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
    proxy = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
    routing = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1]
    for name, bounds, observed in (
        ("stargate_proxy_replay_buffer_bytes", replay, 5000),
        ("stargate_proxy_duration_seconds", proxy, 0.2),
        ("stargate_routing_duration_seconds", routing, 0.0002),
    ):
        expected = [(floatToGoString(b), 1.0 if b >= observed else 0.0) for b in bounds]
        assert buckets(m, name) == [*expected, ("+Inf", 1.0)], name


def test_registries_are_isolated_and_gauge_tracks_active_count() -> None:
    a, b = RouterMetrics(), RouterMetrics()
    a.set_active(T, 3)
    a.set_active(T, 0)
    labels = {"routing_key": "rk", "model": "m"}
    assert a.registry.get_sample_value("stargate_active_inference_servers", labels) == 0
    assert b.registry.get_sample_value("stargate_active_inference_servers", labels) is None


def test_client_chosen_targets_are_bounded_registered_ones_never() -> None:
    m = RouterMetrics()
    m.set_active(Target(None, "served"), 1)
    for i in range(MAX_CLIENT_TARGETS + 50):
        m.request_finished(Target(f"rk-{i}", f"random-{i}"), "", 404)
    m.request_finished(Target(None, "served"), "b1", 200)
    m.set_active(Target(None, "late"), 1)  # a registration after the cap still gets its own labels
    m.request_finished(Target(None, "late"), "b2", 200)
    series = {s.labels["model"] for s in next(iter(m.requests_total.collect())).samples}
    assert len(series) == MAX_CLIENT_TARGETS + 3
    assert {OTHER_TARGET, "served", "late", "random-0"} <= series and "random-1000" not in series
    sample = m.registry.get_sample_value
    other = {"routing_key": OTHER_TARGET, "model": OTHER_TARGET, "inference_server_id": "", "status": "404"}
    assert sample("stargate_requests_total", other) == 50


def test_long_client_chosen_labels_are_other_registered_ones_never() -> None:
    """Series count was bounded, their size not: 1 000 pairs of 8 KB values made a 16 MB page."""
    m = RouterMetrics()
    long = "m" * (MAX_CLIENT_LABEL_CHARS + 1)
    m.request_finished(Target(None, long), "", 404)
    m.request_finished(Target("k" * (MAX_CLIENT_LABEL_CHARS + 1), "short"), "", 404)
    m.request_finished(Target(None, "m" * MAX_CLIENT_LABEL_CHARS), "", 404)
    m.set_active(Target(None, "r" * 300), 1)  # advertised by a registration: its own labels
    m.request_finished(Target(None, "r" * 300), "b1", 200)
    series = {s.labels["model"] for s in next(iter(m.requests_total.collect())).samples}
    assert series == {OTHER_TARGET, "m" * MAX_CLIENT_LABEL_CHARS, "r" * 300}


def backend_series(m: RouterMetrics) -> set[str]:
    families = (m.requests_total, m.proxy_attempts_total, m.proxy_duration_seconds,
                m.quic_connection_evictions_total, m.quic_hot_path_reconnect_total)  # fmt: skip
    return {
        sample.labels["inference_server_id"]
        for family in families
        for metric in family.collect()
        for sample in metric.samples
    }


def test_series_of_a_departed_backend_go_after_the_ttl_unless_it_returns() -> None:
    now = [0.0]
    m = RouterMetrics(clock=lambda: now[0])
    for backend in ("gone", "back", "stays"):
        m.backend_live(backend, True)
        m.request_finished(T, backend, 200)
        m.attempt(T, backend, "success")
        m.proxy_duration(T, backend, 0.1)
        m.eviction(backend, "proxy_error")
        m.reconnect(backend, True)
    m.backend_live("gone", False)
    m.backend_live("back", False)
    now[0] = DEPARTED_SERIES_TTL_S - 1
    m.backend_live("back", True)  # registered again before its series expired
    assert b'inference_server_id="gone"' in m.render()  # scrapes still see its last counts
    now[0] = DEPARTED_SERIES_TTL_S
    m.render()
    assert backend_series(m) == {"back", "stays"}
    m.request_finished(T, "gone", 200)  # a late answer makes its series again, counted from 0
    assert (
        m.registry.get_sample_value(
            "stargate_requests_total",
            {"routing_key": "rk", "model": "m", "inference_server_id": "gone", "status": "200"},
        )
        == 1
    )


def target_series(m: RouterMetrics) -> set[tuple[str, str]]:
    return {
        (sample.labels["routing_key"], sample.labels["model"])
        for family in (m.active_inference_servers, m.requests_total, m.routing_selections_total)
        for metric in family.collect()
        for sample in metric.samples
    }


def test_series_of_a_target_go_after_the_ttl_once_its_last_backend_left() -> None:
    """One sidecar registering 4 096 new model ids again and again grew a scrape past 10 MB."""
    now = [0.0]
    m = RouterMetrics(clock=lambda: now[0])
    gone, back, stays = Target(None, "gone"), Target("rk", "back"), Target(None, "stays")
    for target in (gone, back, stays):
        m.set_active(target, 1)
        m.request_finished(target, "", 503)
        m.selection(target, "random", 1, False)
        m.replay_buffer(target, 10)
    m.set_active(gone, 0, advertised=False)
    m.set_active(back, 0, advertised=False)
    m.set_active(stays, 0)  # no backend in routing, but still registered: not gone
    now[0] = DEPARTED_SERIES_TTL_S - 1
    m.set_active(back, 2)  # a backend registered again before the series expired
    labels = {"routing_key": "", "model": "gone"}
    assert m.registry.get_sample_value("stargate_active_inference_servers", labels) == 0  # for alerts
    now[0] = DEPARTED_SERIES_TTL_S
    m.render()
    assert target_series(m) == {("rk", "back"), ("", "stays")}
    assert b'model="gone"' not in m.render()  # the replay histogram of its model went too
    m.request_finished(gone, "", 404)  # a later request counts as a client-chosen target
    assert ("", "gone") in target_series(m)


def test_targets_gone_faster_than_the_ttl_are_bounded_too() -> None:
    m = RouterMetrics(clock=lambda: 0.0)
    for i in range(3000):
        m.set_active(Target(None, f"m-{i}"), 1)
        m.set_active(Target(None, f"m-{i}"), 0, advertised=False)
    for i in range(1500):  # registered, none in routing: kept whatever their number
        m.set_active(Target(None, f"idle-{i}"), 0)
    series = target_series(m)
    assert len(series) == 2500 and ("", "m-2999") in series and ("", "m-1999") not in series
