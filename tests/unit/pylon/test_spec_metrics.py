"""Pylon metrics of spec pylon.md §12 that are read at scrape time or kept beside other families:
request states, token histograms, dirty snapshots, stats labels, advertised status."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from stargate.balancer.types import ModelStats
from stargate.pylon.live_metrics import LiveLoadCollector
from stargate.pylon.load import Phase
from stargate.pylon.metrics import GONE_ROUTER_TTL_S, PylonMetrics
from stargate.pylon.stats.observation import Endpoint, Observation, State

from .helpers import Rig, make_rig


def samples(metrics: PylonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered text, parsed by the Prometheus parser (so the text is valid)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def with_collector(rig: Rig) -> PylonMetrics:
    hub = rig.hub
    hub.metrics.add_collector(
        LiveLoadCollector(rig.load, hub.counter_entries, hub.model_states, lambda: hub.counter_source)
    )
    return hub.metrics


def test_request_states_and_their_input_tokens_are_read_from_the_live_load_at_scrape_time() -> None:
    rig = make_rig()
    metrics = with_collector(rig)
    rig.load.track("r1", rig.gen, 0, 100)
    rig.load.track("r2", rig.gen, 0, 30)
    rig.load.track("r3", rig.gen, 2, 7)
    rig.load.advance("r2", Phase.INPUT_PROCESSING)
    rig.load.advance("r3", Phase.OUTPUT_GENERATION)
    got = samples(metrics)
    for state, count, tokens in (
        ("pending", 1, 100),
        ("input_processing", 1, 30),
        ("output_generation", 1, 7),
    ):
        labels = (("model", "llama"), ("state", state))
        assert got["pylon_requests_state", labels] == count
        assert got["pylon_requests_state_input_tokens", labels] == tokens
    rig.load.release("r1")
    assert samples(metrics)["pylon_requests_state", (("model", "llama"), ("state", "pending"))] == 0
    assert got["pylon_engine_stats_model_states", (("source", "engine_stats_stream"),)] == 1
    assert got["pylon_engine_stats_live_requests", (("source", "engine_stats_stream"),)] == 0


def test_token_histograms_are_exported_beside_the_token_counters() -> None:
    rig = make_rig()
    metrics = rig.hub.metrics
    obs = Observation(
        "r1", rig.gen, Endpoint.CHAT, State.COMPLETE, input_tokens=50, output_tokens=7, elapsed=1.0
    )
    metrics.request_started("llama")
    metrics.request_finished(obs)
    got = samples(metrics)
    labels = (("model", "llama"), ("routing_key", ""))

    def bucket(le: str) -> tuple[tuple[str, str], ...]:
        return (("le", le), *labels)

    assert got["pylon_request_input_tokens_total", labels] == 50
    assert got["pylon_request_input_tokens_bucket", bucket("10.0")] == 0
    assert got["pylon_request_input_tokens_bucket", bucket("100.0")] == 1
    assert got["pylon_request_input_tokens_count", labels] == 1
    assert got["pylon_request_output_tokens_sum", labels] == 7
    assert got["pylon_request_output_tokens_bucket", bucket("10.0")] == 1
    text = metrics.render().decode().splitlines()
    assert len([line for line in text if line.startswith("pylon_request_input_tokens_created{")]) == 1
    metrics.remove_model("llama")
    assert ("pylon_request_input_tokens_count", labels) not in samples(metrics)


def test_every_snapshot_change_counts_as_dirty_by_source_and_reason() -> None:
    rig = make_rig()
    rig.hub.on_kv("llama", 100, 40, 60)
    rig.hub.on_kv("llama", 100, 50, 50)
    got = samples(rig.hub.metrics)
    labels = (("reason", "kv_cache"), ("source", "kv_cache_stats"))
    assert got["pylon_engine_stats_dirty_snapshots_total", labels] == 2


def test_stats_capability_and_source_gauges_follow_the_published_snapshot() -> None:
    metrics = PylonMetrics()
    metrics.publish_model("m", ModelStats(stats_capabilities=("a", "b"), stats_sources=("s1",)))
    metrics.publish_model("m", ModelStats(stats_capabilities=("b",), stats_sources=("s1", "s2")))
    got = samples(metrics)
    capabilities = {dict(k[1])["capability"] for k in got if k[0] == "pylon_model_stats_capability"}
    sources = {dict(k[1])["source"] for k in got if k[0] == "pylon_model_stats_source"}
    assert (capabilities, sources) == ({"b"}, {"s1", "s2"})
    metrics.remove_model("m")
    assert not [k for k in samples(metrics) if k[0].startswith("pylon_model_stats_")]


def test_advertised_status_is_one_hot_per_router_and_inactive_after_stream_loss() -> None:
    metrics = PylonMetrics()
    metrics.advertise("sg-1", {"a": "active", "b": "inactive"})
    metrics.advertise("sg-1", {"a": "active"})

    def status(model: str) -> dict[str, float]:
        return {
            dict(k[1])["status"]: v
            for k, v in samples(metrics).items()
            if k[0] == "pylon_model_advertised_status" and dict(k[1])["model"] == model
        }

    assert status("a") == {"active": 1, "inactive": 0, "unknown": 0}
    assert status("b") == {}
    metrics.router_lost("sg-1")
    assert status("a") == {"active": 0, "inactive": 1, "unknown": 0}


def test_series_of_a_stargate_gone_from_discovery_expire_unless_it_returns() -> None:
    now = [0.0]
    metrics = PylonMetrics(clock=lambda: now[0])
    for router in ("sg-gone", "sg-back"):
        metrics.registration_connected.labels(router).set(1)
        metrics.advertise(router, {"a": "active"})
        metrics.router_lost(router)
        metrics.router_discovered(router, False)
    now[0] = GONE_ROUTER_TTL_S - 1
    metrics.router_discovered("sg-back", True)
    routers = {dict(k[1]).get("router") for k in samples(metrics)} - {None}
    assert routers == {"sg-gone", "sg-back"}  # still read disconnected, inactive
    now[0] = GONE_ROUTER_TTL_S
    routers = {dict(k[1]).get("router") for k in samples(metrics)} - {None}
    assert routers == {"sg-back"}
