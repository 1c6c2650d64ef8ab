"""``stargate-bench overhead --stargate-only`` end to end on loopback, with tiny counts."""

from __future__ import annotations

from pathlib import Path

import orjson

from stargate.bench.cli import main


def test_overhead_stargate_only(tmp_path: Path) -> None:
    out = tmp_path / "overhead"
    argv = [
        "overhead",
        "--stargate-only",
        "--concurrency",
        "1,4",
        "--requests",
        "16",
        "--duration",
        "10",
        "--warmup",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    data = orjson.loads((out / "overhead.json").read_bytes())
    rows = {(r["target"], r["concurrency"]): r for r in data["rows"]}
    assert set(rows) == {(t, c) for t in ("direct", "stargate", "stargate+pylon") for c in (1, 4)}
    for (target, _), row in rows.items():
        assert row["failed"] == 0
        if target == "direct":
            assert row["throughput_ratio"] is None and row["cpu_ms_per_request"] == {}
            continue
        assert row["throughput_ratio"] > 0 and row["added_p50_ms"] is not None
        names = sorted(name.split("-")[0] for name in row["cpu_ms_per_request"])
        assert names == (["stargate"] if target == "stargate" else ["pylon", "stargate"])
        assert all(value >= 0 for value in row["cpu_ms_per_request"].values())  # 10 ms clock ticks
    measured = [m for m in data["measurements"] if m["target"] != "direct"]
    assert all(m["requests"] == 16 for m in measured)
    assert "| stargate+pylon | 1 |" in (out / "overhead.md").read_text()
