from __future__ import annotations

import os
from pathlib import Path

from stargate.bench.overhead import (
    Measurement,
    OverheadOptions,
    available_targets,
    cpu_ms,
    markdown_table,
    run_order,
    summarize_overhead,
)


def m(
    target: str, slot: int, p50: float, thr: float, conc: int = 1, cpu: dict[str, float] | None = None
) -> Measurement:
    return Measurement(
        target,
        conc,
        slot,
        requests=int(thr * 10),
        failed=0,
        wall_s=10.0,
        p50_ms=p50,
        p99_ms=p50 * 2,
        cpu_ms_per_request=cpu or {},
    )


def test_run_order_puts_direct_around_every_target() -> None:
    assert run_order(["direct", "a", "b"], 1) == ["direct", "a", "direct", "b", "direct"]
    assert run_order(["a"], 2) == ["direct", "a", "direct", "a", "direct"]


def test_summary_pairs_each_run_with_its_neighbouring_directs() -> None:
    runs = [
        m("direct", 0, 1.0, 100.0),
        m("stargate", 1, 2.5, 60.0, cpu={"stargate-0": 0.4}),
        m("direct", 2, 2.0, 80.0),
        m("stargate+pylon", 3, 5.0, 45.0, cpu={"stargate-0": 0.3, "pylon-backend-0": 0.5}),
        m("direct", 4, 1.0, 100.0),
    ]
    rows = {r.target: r for r in summarize_overhead(runs)}
    assert rows["direct"].added_p50_ms is None and rows["direct"].throughput_ratio is None
    assert rows["stargate"].added_p50_ms == 2.5 - 1.5
    assert rows["stargate"].added_p99_ms == 5.0 - 3.0
    assert rows["stargate"].throughput_ratio == 60.0 / 90.0
    assert rows["stargate+pylon"].throughput_ratio == 45.0 / 90.0
    assert rows["stargate+pylon"].cpu_ms_per_request == {"pylon-backend-0": 0.5, "stargate-0": 0.3}
    table = markdown_table(list(rows.values()))
    assert "pylon 0.500, stargate 0.300 (total 0.800)" in table


def test_cpu_ms_reads_this_process_and_none_for_a_gone_pid() -> None:
    first = cpu_ms(os.getpid())
    assert first is not None
    sum(i * i for i in range(300_000))
    second = cpu_ms(os.getpid())
    assert second is not None and second >= first
    assert cpu_ms(2**22 + 12345) is None


def test_uninstalled_peers_are_skipped_with_a_line(tmp_path: Path) -> None:
    options = OverheadOptions(peers_root=tmp_path)
    run, skipped = available_targets(["direct", "stargate", "sglang", "vllm"], options)
    assert run == ["direct", "stargate"]
    assert skipped[0].startswith("sglang: skipped, sglang-router==0.3.2 is not installed")
    run, skipped = available_targets(
        ["direct", "vllm"], OverheadOptions(peers_root=tmp_path, install_peers=True)
    )
    assert run == ["direct", "vllm"] and skipped == []
