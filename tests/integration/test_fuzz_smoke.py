"""``stargate-bench fuzz`` end to end on a real process fleet (1 Stargate, 2 Pylons), tiny count,
routed by power-of-n and by the recommended deployment."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import pytest

from stargate.bench.cli import main
from stargate.bench.fuzz import CATEGORIES, categories, count_tracebacks
from stargate.wire.limits import MAX_PLAUSIBLE_TPS


@pytest.mark.parametrize("routing", [[], ["--recommended"]], ids=["power-of-n", "recommended"])
def test_fuzz_command_reports_every_category_and_the_fleet_survives(
    tmp_path: Path, routing: list[str]
) -> None:
    out = tmp_path / "fuzz"
    argv = ["fuzz", "--requests", "40", "--pylons", "2", "--concurrency", "4", "--out", str(out), *routing]
    code = main(argv)
    report = orjson.loads((out / "fuzz.json").read_bytes())
    assert report["requests"] == {"headers": 16, "bodies": 14, "framing": 6, "grpc": 4}
    assert sum(report["statuses"].values()) == 40
    assert report["undocumented_5xx"] == report["unanswered"] == 0, report["examples"]
    assert report["registration_drops"] == 0
    assert report["routable_at_end"] == {"backend-0": True, "backend-1": True}
    assert set(report["input_tps_at_end"]) == {"backend-0", "backend-1"}
    assert all(0 < tps <= MAX_PLAUSIBLE_TPS for tps in report["input_tps_at_end"].values())
    assert report["final_status"] == 200
    assert report["tracebacks"] == {}
    assert code == 0
    assert "goals met" in (out / "fuzz.md").read_text()
    models = orjson.loads((out / "lb-config.json").read_bytes()).get("models", {})
    assert bool(routing) == (models.get("fuzz-model", {}).get("load_aware") is True)


def test_categories_follow_the_shares_and_the_seed() -> None:
    names = categories(1000, seed=5)
    assert Counter(names) == {name: round(1000 * share) for name, share in CATEGORIES.items()}
    assert names == categories(1000, seed=5) != categories(1000, seed=6)
    assert len(categories(3, seed=0)) == 3


def test_tracebacks_are_counted_per_log_file(tmp_path: Path) -> None:
    (tmp_path / "a.stderr.log").write_text("ok\nTraceback (most recent call last):\nx\n" * 2)
    (tmp_path / "b.stderr.log").write_text("fine\n")
    assert count_tracebacks(tmp_path) == {"a.stderr.log": 2}
