"""``deploy/grafana/stargate-dashboard.json`` only queries metrics that Stargate and Pylon export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from stargate.pylon.live_metrics import LiveLoadCollector
from stargate.pylon.load import LiveLoad
from stargate.pylon.metrics import PylonMetrics
from stargate.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "stargate-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def test_every_queried_metric_is_exported_and_every_spec_gauge_is_shown() -> None:
    pylon = PylonMetrics()
    pylon.add_collector(LiveLoadCollector(LiveLoad(), lambda: 0, lambda: 0, lambda: "chunk_usage"))
    names = exported(RouterMetrics().registry) | exported(pylon.registry)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    queried = {m for e in exprs for m in re.findall(r"\b((?:stargate|pylon)_[a-z_]+)\b", e)}
    assert queried and queried <= names, sorted(queried - names)
    for required in ("pylon_requests_state", "pylon_model_advertised_status", "pylon_model_stats_source"):
        assert required in queried
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
