"""Shared in-memory stand-ins for the router's seams: backends, target views, routing state."""

from __future__ import annotations

import random
from collections.abc import Set
from dataclasses import dataclass, field

from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Policy
from stargate.balancer.types import Candidate, Choice, Decision, LbRequest, Selected, Target
from stargate.router.headers import ProxyRequest
from support.balancer_builders import make_candidate

TARGET = Target(None, "m")


@dataclass(frozen=True)
class FakeBackend:
    inference_server_id: str
    url: str
    cluster_id: str


def backend(backend_id: str, cluster_id: str) -> FakeBackend:
    return FakeBackend(backend_id, f"http://{backend_id}", cluster_id)


@dataclass
class ScriptedPolicy:
    """Answers the scripted decisions in order, repeating the last one."""

    script: list[Decision]
    seen: list[LbRequest] = field(default_factory=list)

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        self.seen.append(request)
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


class FirstEligible:
    """Picks the first non-excluded candidate, like a deterministic balancer."""

    def decide(self, candidates: tuple[Candidate, ...], request: LbRequest, rng: random.Random) -> Decision:
        for i, c in enumerate(candidates):
            if c.cluster_id not in request.excluded:
                return Selected(Choice(i))
        raise AssertionError("the policy must not be called with everything excluded")


@dataclass
class FakeView:
    """A target snapshot: candidates, one policy, and the backends of each cluster in pick order."""

    candidates: tuple[Candidate, ...]
    policy_obj: Policy
    backends: dict[str, list[FakeBackend]]

    def policy(self, definition: AlgorithmDefinition) -> Policy:
        return self.policy_obj

    def pick_backend(self, cluster_id: str, failed_backend_ids: Set[str]) -> FakeBackend | None:
        for b in self.backends.get(cluster_id, []):
            if b.inference_server_id not in failed_backend_ids:
                return b
        return None


@dataclass
class FakeState:
    current: FakeView | None
    advertised: bool = True
    starting: bool = False
    reserved: list[tuple[str, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    first_bytes: list[tuple[int, bool]] = field(default_factory=list)
    """(reservation, answered) of each relayed response's first body byte."""
    prefills: list[int] = field(default_factory=list)
    """Reservations whose prefill ended, in order: at their first byte or their first output."""
    server_errors: list[str] = field(default_factory=list)
    """Backend ids of attempts the backend failed, in order."""
    answers: list[str] = field(default_factory=list)
    """Backend ids of attempts whose answer ended and was no failure, in order."""

    def view(self, target: Target) -> FakeView | None:
        return self.current

    def is_advertised(self, target: Target) -> bool:
        return self.advertised

    def reserve(
        self,
        target: Target,
        backend_id: str,
        input_tokens: int,
        priority: int,
        prefill_tokens: int | None,
        key: str | None,
    ) -> int:
        self.reserved.append((backend_id, input_tokens))
        return len(self.reserved) - 1

    def release(self, reservation: int) -> None:
        self.released.append(reservation)

    def first_byte(
        self, reservation: int, answered: bool = True, prefilled: bool = True, ran: bool = True
    ) -> None:
        self.first_bytes.append((reservation, answered))
        if prefilled:
            self.prefills.append(reservation)

    def prefilled(self, reservation: int) -> None:
        self.prefills.append(reservation)

    def finish(self, reservation: int) -> None:
        self.finished.append(reservation)

    def answered(self, reservation: int) -> None:
        self.answers.append(self.reserved[reservation][0])

    def server_error(self, reservation: int) -> None:
        self.server_errors.append(self.reserved[reservation][0])


def make_view(clusters: dict[str, list[str]], policy: Policy | None = None) -> FakeView:
    candidates = tuple(make_candidate(c, tps=0.0) for c in clusters)  # stats as a fresh registration
    backends = {c: [backend(b, c) for b in ids] for c, ids in clusters.items()}
    return FakeView(candidates, policy or FirstEligible(), backends)


def make_request(received_at: float = 100.0, **kw: object) -> ProxyRequest:
    fields: dict[str, object] = {
        "request_id": "r1",
        "target": TARGET,
        "input_tokens": 10,
        "definition": AlgorithmDefinition(Algorithm.POWER_OF_N),
        "requested_method": None,
        "priority": 0,
        "max_wait_ms": None,
        "request_slo_ms": None,
        "cache_affinity_key": None,
        "retry_budget_ms": None,
        "received_at": received_at,
    }
    fields.update(kw)
    return ProxyRequest(**fields)  # type: ignore[arg-type]
