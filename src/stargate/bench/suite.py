"""Reading results across runs: medians over repeats of one router, and a table across scenarios.

Both work on the plain dicts of ``comparison.json`` so a finished output directory can be summarized
again without re-running anything. One router's repeats are the runs named ``<router> #<n>`` (the names
:func:`stargate.bench.runner.plan_runs` gives them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import orjson

from stargate.errors import ConfigError

_REPEAT = re.compile(r"^(?P<router>.*) #\d+$")
_PEER_KINDS = ("sglang:", "vllm:")


@dataclass(frozen=True)
class RouterResult:
    """One router (or Stargate algorithm) over its repeats; latencies are medians of per-run values."""

    router: str
    runs: int
    success_rate: float  # the worst run's: a lost request in any repeat must show
    requests_per_second: float | None
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p99_ttft_min_ms: float | None
    p99_ttft_max_ms: float | None
    goodput_rps: float | None
    cache_hit_rate: float | None
    inflight_imbalance: float | None = None
    inflight_imbalance_p99: float | None = None
    slot_inflight_imbalance: float | None = None
    prefill_inflight_imbalance: float | None = None

    @property
    def is_stargate(self) -> bool:
        return self.router.startswith("stargate:")

    @property
    def is_peer(self) -> bool:
        return self.router.startswith(_PEER_KINDS)


def router_of(run: str) -> str:
    match = _REPEAT.match(run)
    return match.group("router") if match else run


def _of(pick: Callable[[list[float]], float], rows: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """``pick`` over the runs that have a value (a run without one is left out, not counted as zero)."""
    values = [float(row[key]) for row in rows if row.get(key) is not None]
    return pick(values) if values else None


def across_repeats(rows: Sequence[Mapping[str, Any]]) -> list[RouterResult]:
    """Group runs by router, in first-seen order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(router_of(str(row["run"])), []).append(row)
    return [
        RouterResult(
            router=router,
            runs=len(runs),
            success_rate=min(float(r["success_rate"]) for r in runs),
            requests_per_second=_of(median, runs, "requests_per_second"),
            p50_ttft_ms=_of(median, runs, "p50_ttft_ms"),
            p99_ttft_ms=_of(median, runs, "p99_ttft_ms"),
            p99_ttft_min_ms=_of(min, runs, "p99_ttft_ms"),
            p99_ttft_max_ms=_of(max, runs, "p99_ttft_ms"),
            goodput_rps=_of(median, runs, "goodput_rps"),
            cache_hit_rate=_of(median, runs, "cache_hit_rate"),
            inflight_imbalance=_of(median, runs, "inflight_imbalance"),
            inflight_imbalance_p99=_of(median, runs, "inflight_imbalance_p99"),
            slot_inflight_imbalance=_of(median, runs, "slot_inflight_imbalance"),
            prefill_inflight_imbalance=_of(median, runs, "prefill_inflight_imbalance"),
        )
        for router, runs in groups.items()
    ]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def repeats_table(results: Sequence[RouterResult]) -> list[str]:
    """Markdown lines: one row per router, medians over its runs."""
    return markdown_table(
        ["Router", "Runs", "Worst success", "Req/s", "TTFT p50 ms", "TTFT p99 ms", "p99 range ms",
         "Goodput req/s", "Cache-hit req", "In-flight imb", "In-flight imb p99", "Per-slot imb",
         "Prefill imb"],
        [
            [r.router, str(r.runs), _pct(r.success_rate), _num(r.requests_per_second, 2),
             _num(r.p50_ttft_ms), _num(r.p99_ttft_ms),
             f"{_num(r.p99_ttft_min_ms)} to {_num(r.p99_ttft_max_ms)}", _num(r.goodput_rps, 2),
             _pct(r.cache_hit_rate), _num(r.inflight_imbalance, 2), _num(r.inflight_imbalance_p99, 2),
             _num(r.slot_inflight_imbalance, 2), _num(r.prefill_inflight_imbalance, 2)]
            for r in results
        ],
    )  # fmt: skip


@dataclass(frozen=True)
class ScenarioStanding:
    """Where Stargate's best algorithm stands against the peer routers in one scenario."""

    scenario: str
    stargate: RouterResult
    best_p99_peer: RouterResult | None
    best_goodput_peer: RouterResult | None
    direct: RouterResult | None
    peers_compared: bool = False  # some peer ran, so a missing best peer means none completed

    @property
    def p99_ratio(self) -> float | None:
        peer = self.best_p99_peer
        return _over(self.stargate.p99_ttft_ms, peer.p99_ttft_ms if peer else None)

    @property
    def goodput_ratio(self) -> float | None:
        peer = self.best_goodput_peer
        return _over(self.stargate.goodput_rps, peer.goodput_rps if peer else None)


def _over(ours: float | None, theirs: float | None) -> float | None:
    """Stargate's value over the peer's; None when either is missing or the peer's is zero."""
    return None if ours is None or not theirs else ours / theirs


def _p99_key(result: RouterResult) -> tuple[float, float, float]:
    """Stargate's best algorithm, lower is better: lost requests first, then TTFT p99, then (negated)
    goodput."""
    p99 = result.p99_ttft_ms if result.p99_ttft_ms is not None else float("inf")
    return (-result.success_rate, p99, -(result.goodput_rps or 0.0))


def _completed(result: RouterResult) -> bool:
    """A peer that answered requests; one whose every run failed (not installable, say) has no TTFT."""
    return result.p99_ttft_ms is not None


def standing(scenario: str, results: Sequence[RouterResult]) -> ScenarioStanding | None:
    """Stargate's best algorithm (by TTFT p99) against the best peer on each measure; None if no Stargate.

    The best peer is the lowest TTFT p99 or the highest goodput of the peers that completed, whatever
    their success rate: the caption says so, and the per-scenario tables show the lost requests.
    """
    stargates = [r for r in results if r.is_stargate]
    if not stargates:
        return None
    peers = [r for r in results if r.is_peer]
    completed = [r for r in peers if _completed(r)]
    direct = next((r for r in results if r.router == "direct"), None)
    return ScenarioStanding(
        scenario=scenario,
        stargate=min(stargates, key=_p99_key),
        best_p99_peer=min(completed, key=lambda r: r.p99_ttft_ms or 0.0) if completed else None,
        best_goodput_peer=max(completed, key=lambda r: r.goodput_rps or 0.0) if completed else None,
        direct=direct,
        peers_compared=bool(peers),
    )


def load_suite(root: Path) -> dict[str, list[RouterResult]]:
    """Every ``<root>/<scenario>/comparison.json``, by scenario in name order; a file that is not
    one (corrupt, another tool's) is a usage error naming it."""
    suite = {}
    for path in sorted(root.glob("*/comparison.json")):
        try:
            suite[path.parent.name] = across_repeats(orjson.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            reason = f"not a comparison.json of stargate-bench compare ({type(exc).__name__}: {exc})"
            raise ConfigError(reason, file=str(path)) from exc
    return suite


def _who(row: ScenarioStanding, result: RouterResult | None, attr: str, digits: int) -> str:
    if result is None:
        return "none completed" if row.peers_compared else "-"
    return f"{_num(getattr(result, attr), digits)} ({result.router})"


def standings_table(standings: Sequence[ScenarioStanding]) -> list[str]:
    """Markdown lines: per scenario, Stargate's best against the best peer; ratios are Stargate / peer."""
    return markdown_table(
        ["Scenario", "Stargate best", "Runs", "TTFT p99 ms", "Goodput req/s", "Best peer p99 ms",
         "p99 ratio", "Best peer goodput", "Goodput ratio", "Direct p99 ms", "Cache-hit (Stargate)",
         "In-flight imb", "Best peer imb", "Per-slot imb", "Best peer per-slot imb", "Prefill imb",
         "Best peer prefill imb"],
        [
            [s.scenario, s.stargate.router.removeprefix("stargate:"), str(s.stargate.runs),
             _num(s.stargate.p99_ttft_ms), _num(s.stargate.goodput_rps, 2),
             _who(s, s.best_p99_peer, "p99_ttft_ms", 0), _num(s.p99_ratio, 2),
             _who(s, s.best_goodput_peer, "goodput_rps", 2), _num(s.goodput_ratio, 2),
             _num(s.direct.p99_ttft_ms) if s.direct else "-", _pct(s.stargate.cache_hit_rate),
             _num(s.stargate.inflight_imbalance, 2), _who(s, s.best_p99_peer, "inflight_imbalance", 2),
             _num(s.stargate.slot_inflight_imbalance, 2),
             _who(s, s.best_p99_peer, "slot_inflight_imbalance", 2),
             _num(s.stargate.prefill_inflight_imbalance, 2),
             _who(s, s.best_p99_peer, "prefill_inflight_imbalance", 2)]
            for s in standings
        ],
    )  # fmt: skip


def write_summary(root: Path) -> tuple[Path, str]:
    """``<root>/summary.md``: the standings table plus each scenario's per-router medians."""
    suite = load_suite(root)
    standings = [s for name, results in suite.items() if (s := standing(name, results)) is not None]
    lines = ["# Side by side: Stargate's best algorithm against the peer routers", ""]
    lines += [
        "Medians over each router's repeats. p99 ratio below 1 and goodput ratio at or above 1 mean "
        "Stargate leads. Best peer is the best of sglang-router and vllm-router on that measure, of "
        "those that answered requests (their success rates are in the tables below). "
        "In-flight imb: time-weighted mean of max / mean requests in flight across backends "
        "(1 = even; docs/bench.md), Stargate's best against the best-p99 peer's; per-slot: the same "
        "over requests per engine slot, the figure to compare on fleets of unequal backends; "
        "prefill: per slot, over the requests still waiting for their first token.",
        "",
        *standings_table(standings),
    ]
    for name, results in suite.items():
        lines += ["", f"## {name}", "", *repeats_table(results)]
    text = "\n".join(lines) + "\n"
    out = root / "summary.md"
    out.write_text(text, encoding="utf-8")
    return out, text
