"""Time-resolved in-flight imbalance: how unevenly requests sit on the backends while the run goes on.

Balance scores over totals hide pile-ups (one backend holding 25 requests for a minute while another
holds 2 can still end with equal totals). This measure follows the in-flight counts over time, exactly
(piecewise constant between dispatches and ends, no sampling grid). Definitions (docs/bench.md):

* ``n_b(t)``: requests attributed to backend ``b`` with ``dispatch_s <= t < finished_s``;
  ``N(t) = Σ_b n_b(t)``; ``B`` = number of backends of the topology, idle ones included.
* ``r(t) = max_b n_b(t) / (N(t) / B)`` where ``N(t) > 0``: 1 when every backend holds the same
  number, ``B`` when one holds everything. Moments with nothing in flight are left out.
* ``mean`` = time-weighted mean of ``r`` over the busy time; ``p99`` = the time-weighted 99th
  percentile (the smallest ``v`` with ``r(t) <= v`` for at least 99 % of the busy time).
* Per slot (``slots`` given): ``r(t) = max_b (n_b(t) / s_b) / (N(t) / S)`` with ``s_b`` the
  backend's engine slots and ``S`` their sum. On a fleet of unequal backends a router that gives a
  big backend more requests than a small one is not piling up; this measure says so, the plain one
  does not. With equal slots the two are the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Imbalance:
    mean: float | None
    p99: float | None
    busy_s: float


def weighted_quantile(samples: Sequence[tuple[float, float]], q: float) -> float | None:
    """Smallest value whose cumulative weight reaches ``q`` of the total; samples are (value, weight)."""
    total = sum(weight for _, weight in samples)
    if total <= 0:
        return None
    running = 0.0
    ordered = sorted(samples)
    for value, weight in ordered:
        running += weight
        if running >= q * total * (1 - 1e-12):
            return value
    return ordered[-1][0]


def in_flight_imbalance(
    spans: Iterable[tuple[str, float, float]],
    members: Sequence[str],
    slots: Mapping[str, float] | None = None,
) -> Imbalance:
    """``spans``: (backend, dispatch_s, finished_s) per request; ``members``: every backend id;
    ``slots``: each backend's capacity for the per-slot measure (a backend missing from it counts 1)."""
    events: list[tuple[float, int, str]] = []
    for member, start, end in spans:
        if end > start:
            events += [(start, 1, member), (end, -1, member)]
    counts = dict.fromkeys(members, 0)
    for _, _, member in events:
        counts.setdefault(member, 0)
    if not events or not counts:
        return Imbalance(None, None, 0.0)
    events.sort()
    size = {member: 1.0 for member in counts} if slots is None else {m: slots.get(m, 1.0) for m in counts}
    capacity = sum(size.values())
    samples: list[tuple[float, float]] = []
    total = 0
    index = 0
    while index < len(events):
        now = events[index][0]
        while index < len(events) and events[index][0] == now:
            _, delta, member = events[index]
            counts[member] += delta
            total += delta
            index += 1
        if total > 0 and index < len(events):
            peak = max(count / size[member] for member, count in counts.items())
            samples.append((peak * capacity / total, events[index][0] - now))
    busy = sum(weight for _, weight in samples)
    mean = sum(value * weight for value, weight in samples) / busy if busy > 0 else None
    return Imbalance(mean, weighted_quantile(samples, 0.99), busy)
