"""The pure decision core: snapshots and a request in, a ``Decision`` out. No I/O, no clocks."""

from __future__ import annotations

from stargate.balancer.admission import AdmissionRejection, check_admission
from stargate.balancer.estimates import (
    effective_queue_ms,
    expected_queue_ms,
    has_free_slot,
    queue_estimate,
    with_reservation,
    with_reservations,
)
from stargate.balancer.registry import ALIASES, build_policy
from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Comparator, Policy
from stargate.balancer.types import (
    EMPTY_PRIORITY_MAP,
    UNAVAILABLE,
    Candidate,
    Choice,
    Decision,
    LbRequest,
    ModelStats,
    Selected,
    Target,
    Unavailable,
    Wait,
    valid_tps,
)

__all__ = [
    "ALIASES",
    "EMPTY_PRIORITY_MAP",
    "UNAVAILABLE",
    "AdmissionRejection",
    "Algorithm",
    "AlgorithmDefinition",
    "Candidate",
    "Choice",
    "Comparator",
    "Decision",
    "LbRequest",
    "ModelStats",
    "Policy",
    "Selected",
    "Target",
    "Unavailable",
    "Wait",
    "build_policy",
    "check_admission",
    "effective_queue_ms",
    "expected_queue_ms",
    "has_free_slot",
    "queue_estimate",
    "valid_tps",
    "with_reservation",
    "with_reservations",
]
