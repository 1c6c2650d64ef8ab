"""Routing state: live registrations, routing targets and their shared snapshots (spec §1.2 to §1.11).

All mutation happens synchronously on the event loop, so every operation is atomic with respect to
requests. Readers take a ``TargetView`` (an immutable snapshot rebuilt only when the target
changes) and keep it for the whole routing attempt.

Generations (§1.4): each admission gets a registration generation, and cleanup or updates from a
stale handle never touch a same-id replacement. Registrations of one ``(routing_key, cluster_id)``
share a cluster generation; a cluster entry bound to a retired one is replaced, not merged. A
target is retired when its last cluster disappears; a later publication creates a new generation
with fresh load-balancer instances and counters.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from stargate.balancer import build_policy
from stargate.balancer.estimates import with_assumed_rates
from stargate.balancer.settings import AlgorithmDefinition, Policy, RouteLearner
from stargate.balancer.types import AffinityRoute, Candidate, ModelStats, Target
from stargate.errors import RequestError
from stargate.router.clusters import Backend, BackendPicker, ClusterState, Member, Reservation

__all__ = ["Backend", "RegistrationHandle", "Reservation", "RoutingState", "TargetView"]

BLANK_MODEL_ID_MESSAGE = "model_ids must not contain empty values"
STARTUP_GRACE_S = 10.0
"""A restarted router's Pylons register again within their reconnect backoff (at most 5 s)."""
SERVER_ERRORS_IN_A_ROW = 5
"""Answers of one backend for one model in a row that were server errors before it is taken out of
routing for that model: an engine that fails every request answers at once, so the load-aware
estimate would see it idle and send it most of the traffic until its Pylon's next canary. Counted
per model: an engine fails one model's requests (its weights, its adapter) while it serves others."""
SERVER_ERROR_HOLD_S = 10.0
"""How long a backend whose answers for a model were server errors stays out of routing for it
(then its next update decides, and its Pylon's canaries have had two periods to mark a broken
model inactive)."""
SERVER_ERROR_HOLD_SHARE = 0.1
"""The share of a model's backends that may be held out for server errors at once (at least one,
never the last): Envoy's ``max_ejection_percent``. Requests that make every engine fail must not
take most of a fleet out, one backend after another."""


class TargetView:
    """Immutable snapshot of one routing target with pending reservations applied.

    ``candidates`` is shared by every reader until the target changes. Policy instances and the
    per-cluster backend counters belong to the target generation, so views of one generation share
    them and a view taken before a retirement keeps the old ones.
    """

    __slots__ = ("_on_new_policy", "_pickers", "_policies", "candidates", "generation", "target")

    def __init__(
        self,
        target: Target,
        generation: int,
        candidates: tuple[Candidate, ...],
        pickers: Mapping[str, BackendPicker],
        policies: dict[AlgorithmDefinition, Policy],
        on_new_policy: Callable[[Policy], None] = lambda _policy: None,
    ) -> None:
        self.target = target
        self.generation = generation
        self.candidates = candidates
        self._pickers = pickers
        self._policies = policies
        self._on_new_policy = on_new_policy

    def policy(self, definition: AlgorithmDefinition) -> Policy:
        """The load balancer of this target generation for ``definition`` (compared by identity)."""
        policy = self._policies.get(definition)
        if policy is None:
            policy = self._policies[definition] = build_policy(definition)
            self._on_new_policy(policy)
        return policy

    def pick_backend(self, cluster_id: str, failed_backend_ids: Set[str] = frozenset()) -> Backend | None:
        """Round robin over the cluster's backends sorted by id, skipping failed ones (§1.11)."""
        picker = self._pickers.get(cluster_id)
        return None if picker is None else picker.pick(failed_backend_ids)

    def backends(self, cluster_id: str) -> tuple[Backend, ...]:
        picker = self._pickers.get(cluster_id)
        return () if picker is None else picker.backends


@dataclass(frozen=True, slots=True)
class RegistrationHandle:
    """Proof of one admission; every registration-side call must present it."""

    backend: Backend
    routing_key: str | None
    generation: int


@dataclass(slots=True)
class _Registration:
    handle: RegistrationHandle
    advertised: frozenset[str] = frozenset()
    active: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _ClusterGeneration:
    generation: int
    members: int = 0


class _TargetState:
    __slots__ = ("clusters", "generation", "on_new_policy", "pickers", "policies", "route_marks", "view")

    def __init__(
        self, target: Target, generation: int, on_new_policy: Callable[[_TargetState, Policy], None]
    ) -> None:
        self.generation = generation
        self.clusters: dict[str, ClusterState] = {}
        self.route_marks: dict[str, int] = {}  # per backend: newest published route already learnt
        self.policies: dict[AlgorithmDefinition, Policy] = {}
        self.pickers: dict[str, BackendPicker] = {}
        self.on_new_policy: Callable[[Policy], None] = functools.partial(on_new_policy, self)
        self.view = TargetView(target, generation, (), self.pickers, self.policies, self.on_new_policy)

    def rebuild(self, target: Target, *, membership_changed: bool) -> None:
        if membership_changed:
            self.pickers = {cid: c.picker for cid, c in self.clusters.items()}
        candidates = with_assumed_rates(tuple(c.candidate for c in self.clusters.values()))
        self.view = TargetView(
            target, self.generation, candidates, self.pickers, self.policies, self.on_new_policy
        )

    def active_count(self) -> int:
        return sum(len(c.members) for c in self.clusters.values())

    def in_flight(self, key: str) -> bool:
        """This router has a request of ``key`` in flight to one of the target's clusters."""
        return any(cluster.has_in_flight(key) for cluster in self.clusters.values())


class RoutingState:
    """Every live registration and routing target of this process.

    ``on_active_count(target, n, advertised)`` runs after every registration-side change of a target
    with its active backend count (0 once it is gone) and whether a registration still lists it;
    reservations do not change the count and do not call it.
    ``on_backend_live(backend_id, live)`` runs when a registration is admitted and when it ends.
    ``on_server_errors(backend_id, model_id, n)`` runs when a backend's last
    ``SERVER_ERRORS_IN_A_ROW`` answers for a model were failures (``server_error``), another
    backend serves the model and few enough of its backends are held already: the backend is then
    out of routing for that model for ``SERVER_ERROR_HOLD_S``, whatever its updates say.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_active_count: Callable[[Target, int, bool], None] | None = None,
        on_backend_live: Callable[[str, bool], None] = lambda _backend_id, _live: None,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._on_active_count = on_active_count
        self._on_backend_live = on_backend_live
        self._generations = itertools.count(1)
        self._live: dict[str, _Registration] = {}
        self._cluster_generations: dict[tuple[str | None, str], _ClusterGeneration] = {}
        self._targets: dict[Target, _TargetState] = {}
        self._advertised: dict[Target, int] = {}
        self._answered: dict[str, float] = {}  # backend id -> when a response of it last began
        self._server_errors: dict[tuple[str, Target], int] = {}  # (backend id, target) -> failures in a row
        self._held: dict[tuple[str, Target], float] = {}  # (backend id, target) -> end of its hold
        self.on_server_errors: Callable[[str, str, int], None] = lambda _backend_id, _model_id, _count: None
        self._started = clock()

    # ---- readers (proxy side) ------------------------------------------------------------------

    @property
    def starting(self) -> bool:
        """Within ``STARTUP_GRACE_S`` of this state's creation: a model nobody advertises yet may
        be one whose backends have not registered again since the router started."""
        return self._clock() - self._started < STARTUP_GRACE_S

    def view(self, target: Target) -> TargetView | None:
        state = self._targets.get(target)
        return None if state is None else state.view

    def is_advertised(self, target: Target) -> bool:
        """Whether any live registration lists the model in its latest update, whatever its status."""
        return self._advertised.get(target, 0) > 0

    def list_models(self, routing_key: str | None, model_ids: Sequence[str] = ()) -> list[str]:
        """Sorted unique ids of models with an active backend for the routing key (§5.8).

        A blank routing key means unscoped; a blank filter raises ``RequestError``.
        """
        key = routing_key.strip() if routing_key is not None else None
        key = key or None
        wanted = [m.strip() for m in model_ids]
        if any(not m for m in wanted):
            raise RequestError(BLANK_MODEL_ID_MESSAGE)
        if wanted:
            return sorted({m for m in wanted if Target(key, m) in self._targets})
        return sorted({t.model_id for t in self._targets if t.routing_key == key})

    def active_model_ids(self) -> list[str]:
        return sorted({t.model_id for t in self._targets})

    def describe(self) -> list[dict[str, object]]:
        """Operator view of every routing target: the candidates the balancer sees, and their members.

        Candidate stats include pending reservations; backend URLs and tokens are left out.
        """
        now = self._clock()
        out: list[dict[str, object]] = []
        for target, state in sorted(
            self._targets.items(), key=lambda item: (item[0].routing_key or "", item[0].model_id)
        ):
            clusters = []
            for cluster_id, cluster in sorted(state.clusters.items()):
                clusters.append(
                    {
                        "cluster_id": cluster_id,
                        "stats": _stats_json(cluster.candidate.stats),
                        "rtt_ms": round(cluster.candidate.rtt_s * 1000.0, 3),
                        "pending_reservations": len(cluster.reservations),
                        "measured_input_tps": round(cluster.candidate.measured_input_tps, 1),
                        "measured_slot_ms": round(cluster.candidate.measured_slot_s * 1000.0, 1),
                        "in_flight": {
                            "requests": cluster.candidate.in_flight.requests,
                            "prefilling": cluster.candidate.in_flight.prefilling,
                            "prefill_tokens": cluster.candidate.in_flight.prefill_tokens,
                        },
                        "backends": [
                            {
                                "inference_server_id": backend_id,
                                "rtt_ms": round(member.rtt_ns / 1e6, 3),
                                "updated_s_ago": round(max(0.0, now - member.updated_at), 3),
                                "stats": _stats_json(member.stats),
                            }
                            for backend_id, member in sorted(cluster.members.items())
                        ],
                    }
                )
            out.append(
                {
                    "routing_key": target.routing_key,
                    "model_id": target.model_id,
                    "generation": state.generation,
                    "clusters": clusters,
                }
            )
        return out

    def registration_count(self) -> int:
        return len(self._live)

    def is_registered(self, inference_server_id: str) -> bool:
        return inference_server_id in self._live

    def is_routable(self, inference_server_id: str, url: str | None = None) -> bool:
        """Registered and in routing for some model: not ejected by its health probes, nor with
        every model advertised INACTIVE or held out for server errors. With ``url``, the
        registration must be the one at that address: a new registration may have taken the id of
        one that hung."""
        registration = self._live.get(inference_server_id)
        if registration is None or (url is not None and registration.handle.backend.url != url):
            return False
        return bool(registration.active)

    # ---- reservations (§1.9) and the router's own in-flight count --------------------------------

    def reserve(
        self,
        target: Target,
        backend_id: str,
        input_tokens: int,
        priority: int,
        prefill_tokens: int | None = None,
        key: str | None = None,
    ) -> Reservation:
        """Add one attempt's optimistic load and in-flight record to its cluster; inert if the backend
        left. The attempt's driver must end it with ``finish``. ``prefill_tokens`` is the uncached
        part of the prompt the decision expected (default: all of it); ``key`` its cache-affinity key."""
        registration = self._live.get(backend_id)
        cluster_id = registration.handle.backend.cluster_id if registration else ""
        tokens = max(0, input_tokens)
        work = tokens if prefill_tokens is None else min(tokens, max(0, prefill_tokens))
        reservation = Reservation(target, cluster_id, backend_id, tokens, priority, work, key)
        state = self._targets.get(target)
        cluster = state.clusters.get(cluster_id) if state is not None else None
        if state is not None and cluster is not None and backend_id in cluster.members:
            cluster.add_reservation(reservation)
            cluster.start(reservation)
            state.rebuild(target, membership_changed=False)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """End only the optimistic load (the backend refused the attempt: §1.9 (c))."""
        self._change(reservation, ClusterState.release)

    def first_byte(
        self, reservation: Reservation, answered: bool = True, prefilled: bool = True, ran: bool = True
    ) -> None:
        """The attempt's first response byte arrived. ``answered``: the response is no server
        error, so the backend is alive (``answered_within``); a Pylon whose engine is down answers
        5xx at once. ``prefilled``: the byte is its first token, so it no longer counts as prefill
        work (else ``prefilled`` follows). ``ran``: a 2xx, the engine ran it; a refusal measures
        neither the prefill rate nor a slot's hold (ten-million-token prompts an engine refused
        at once read as 24 million tokens/s prefilled)."""
        if answered and reservation.backend_id in self._live:
            self._answered[reservation.backend_id] = self._clock()
        if not ran:
            reservation.ran = False
        if prefilled:
            self._change(reservation, ClusterState.first_byte)

    def answered(self, reservation: Reservation) -> None:
        """The attempt's answer ended and was no failure: the backend's row of failures for the
        model starts again. At its end, not its first byte: a backend that cuts every stream
        began each answer."""
        self._server_errors.pop((reservation.backend_id, reservation.target), None)

    def server_error(self, reservation: Reservation) -> None:
        """The backend failed the attempt: a server error, a refusal without the retry signal, a
        connection it closed unanswered or an answer it cut (Envoy's gateway failures). A backend
        that passes its probes and fails every request ends them at once, so the load-aware
        estimate saw it idle and sent it most of the traffic. Not counted for a backend out of
        routing for the model: its failures may be this router giving up on it."""
        backend_id, target = reservation.backend_id, reservation.target
        registration = self._live.get(backend_id)
        if (
            registration is None
            or registration.handle.routing_key != target.routing_key
            or target.model_id not in registration.active
        ):
            return
        key = (backend_id, target)
        errors = self._server_errors[key] = self._server_errors.get(key, 0) + 1
        if errors >= SERVER_ERRORS_IN_A_ROW and self._may_hold(target):
            del self._server_errors[key]
            self._held[key] = self._clock() + SERVER_ERROR_HOLD_S
            self._remove_member(target, registration.handle)
            registration.active.discard(target.model_id)
            self._report([target])
            self.on_server_errors(backend_id, target.model_id, errors)

    def prefilled(self, reservation: Reservation) -> None:
        """The attempt's first token arrived after other bytes: its prefill is over."""
        self._change(reservation, ClusterState.first_byte)

    def _may_hold(self, target: Target) -> bool:
        """Whether another backend is in routing for the model, and fewer of its backends are held
        out than ``SERVER_ERROR_HOLD_SHARE`` allows."""
        now = self._clock()
        self._held = {key: until for key, until in self._held.items() if until > now}
        state = self._targets.get(target)
        if state is None or state.active_count() < 2:
            return False
        allowed = max(1, int(self._advertised.get(target, 0) * SERVER_ERROR_HOLD_SHARE))
        return sum(held == target for _, held in self._held) < allowed

    def answered_within(self, backend_id: str, seconds: float) -> bool:
        """Whether a response of the backend began within the last ``seconds``: a backend busy
        enough to answer its health probe late is still alive while it answers requests."""
        at = self._answered.get(backend_id)
        return at is not None and self._clock() - at <= seconds

    def finish(self, reservation: Reservation) -> None:
        """The attempt ended (any outcome): a pending reservation ends with it (not in the original,
        whose reservations wait for the next heartbeat even when the request is long over)."""
        self._change(reservation, ClusterState.finish)

    def _change(self, reservation: Reservation, change: Callable[[ClusterState, Reservation], bool]) -> None:
        state = self._targets.get(reservation.target)
        cluster = state.clusters.get(reservation.cluster_id) if state is not None else None
        if state is not None and cluster is not None and change(cluster, reservation):
            state.rebuild(reservation.target, membership_changed=False)

    # ---- registrations (control plane side) ----------------------------------------------------

    def admit(
        self, inference_server_id: str, url: str, cluster_id: str, routing_key: str | None
    ) -> RegistrationHandle | None:
        """Admit a registration; ``None`` when the id already belongs to a live registration."""
        if inference_server_id in self._live:
            return None
        effective_cluster = cluster_id or inference_server_id
        key = (routing_key, effective_cluster)
        cluster_generation = self._cluster_generations.get(key)
        if cluster_generation is None:
            cluster_generation = self._cluster_generations[key] = _ClusterGeneration(next(self._generations))
        cluster_generation.members += 1
        backend = Backend(inference_server_id, url, effective_cluster)
        handle = RegistrationHandle(backend, routing_key, next(self._generations))
        self._live[inference_server_id] = _Registration(handle)
        self._on_backend_live(inference_server_id, True)
        return handle

    def apply_update(
        self, handle: RegistrationHandle, models: Mapping[str, ModelStats | None], rtt_ns: int | None
    ) -> bool:
        """Apply one full snapshot (§1.6). ``models`` maps every listed model to its stats when the
        effective status is ACTIVE, else ``None``; without an RTT no model is routable, nor is one
        held out for server errors.

        Returns ``False`` (and changes nothing) for a handle that is no longer live.
        """
        registration = self._current(handle)
        if registration is None:
            return False
        routing_key = handle.routing_key
        listed = frozenset(models)
        touched = self._readvertise(routing_key, registration.advertised, listed)
        registration.advertised = listed
        for model_id in [m for m in registration.active if m not in models]:
            target = Target(routing_key, model_id)
            self._remove_member(target, handle)
            registration.active.discard(model_id)
            touched.append(target)
        now = self._clock()
        backend_id = handle.backend.inference_server_id
        for model_id, stats in models.items():
            target = Target(routing_key, model_id)
            held = self._held.get((backend_id, target), now) > now
            if stats is not None and rtt_ns is not None and not held:
                self._upsert(target, handle, Member(handle.backend, stats, rtt_ns, now, handle.generation))
                registration.active.add(model_id)
            elif model_id in registration.active:
                self._remove_member(target, handle)
                registration.active.discard(model_id)
            touched.append(target)
        self._report(touched)
        return True

    def remove(self, handle: RegistrationHandle) -> None:
        """End a registration: remove its routes, release its id, retire its cluster generation."""
        registration = self._current(handle)
        if registration is None:
            return
        routing_key = handle.routing_key
        touched = [Target(routing_key, m) for m in registration.active]
        for target in touched:
            self._remove_member(target, handle)
        touched += self._readvertise(routing_key, registration.advertised, frozenset())
        backend_id = handle.backend.inference_server_id
        del self._live[backend_id]
        self._answered.pop(backend_id, None)
        self._server_errors = {key: n for key, n in self._server_errors.items() if key[0] != backend_id}
        self._held = {key: until for key, until in self._held.items() if key[0] != backend_id}
        key = (routing_key, handle.backend.cluster_id)
        cluster_generation = self._cluster_generations[key]
        cluster_generation.members -= 1
        if cluster_generation.members == 0:
            del self._cluster_generations[key]
        self._report(touched)
        self._on_backend_live(backend_id, False)

    # ---- internals -----------------------------------------------------------------------------

    def _current(self, handle: RegistrationHandle) -> _Registration | None:
        registration = self._live.get(handle.backend.inference_server_id)
        if registration is None or registration.handle.generation != handle.generation:
            return None
        return registration

    def _readvertise(
        self, routing_key: str | None, before: frozenset[str], after: frozenset[str]
    ) -> list[Target]:
        """Count the registration's advertised models; the targets whose count changed."""
        changed = []
        for model_id in before - after:
            target = Target(routing_key, model_id)
            remaining = self._advertised[target] - 1
            if remaining:
                self._advertised[target] = remaining
            else:
                del self._advertised[target]
            changed.append(target)
        for model_id in after - before:
            target = Target(routing_key, model_id)
            self._advertised[target] = self._advertised.get(target, 0) + 1
            changed.append(target)
        return changed

    def _upsert(self, target: Target, handle: RegistrationHandle, member: Member) -> None:
        state = self._targets.get(target)
        if state is None:
            state = self._targets[target] = _TargetState(target, next(self._generations), self._catch_up)
        cluster_id = handle.backend.cluster_id
        generation = self._cluster_generations[(handle.routing_key, cluster_id)].generation
        cluster = state.clusters.get(cluster_id)
        if cluster is None or cluster.generation != generation:
            cluster = state.clusters[cluster_id] = ClusterState(cluster_id, generation, self._clock)
        joined = member.backend.inference_server_id not in cluster.members
        cluster.upsert(member)
        state.rebuild(target, membership_changed=joined)
        routes = member.stats.recent_cache_affinity_routes
        if routes and state.policies:
            self._learn(state, cluster_id, member.backend.inference_server_id, routes)

    def _learn(
        self, state: _TargetState, cluster_id: str, backend_id: str, routes: Sequence[AffinityRoute]
    ) -> None:
        """Hand the routes a backend published (each is in several heartbeats) to the target's
        policies, each once: Pylon lists them oldest first, and the newest is handed again, as
        routes of the same millisecond may come in the next message."""
        mark = state.route_marks.get(backend_id, 0)
        start = len(routes)
        while start and routes[start - 1].admitted_at_unix_ms >= mark:
            start -= 1
        state.route_marks[backend_id] = routes[-1].admitted_at_unix_ms
        self._hand(state, state.policies.values(), cluster_id, routes[start:])

    def _catch_up(self, state: _TargetState, policy: Policy) -> None:
        """A new policy learns the routes the backends published last (a key's newest route wins
        in whatever order they come)."""
        for cluster_id, cluster in state.clusters.items():
            for member in cluster.members.values():
                self._hand(state, (policy,), cluster_id, member.stats.recent_cache_affinity_routes)

    def _hand(
        self,
        state: _TargetState,
        policies: Iterable[Policy],
        cluster_id: str,
        routes: Sequence[AffinityRoute],
    ) -> None:
        if not routes:
            return
        offset_s = self._clock() - self._wall_clock()
        for policy in policies:
            if isinstance(policy, RouteLearner):
                policy.learn_routes(cluster_id, routes, offset_s, state.in_flight)

    def _remove_member(self, target: Target, handle: RegistrationHandle) -> None:
        state = self._targets.get(target)
        if state is None:
            return
        cluster_id = handle.backend.cluster_id
        cluster = state.clusters.get(cluster_id)
        if cluster is None:
            return
        member = cluster.members.get(handle.backend.inference_server_id)
        if member is None or member.generation != handle.generation:
            return
        cluster.remove(handle.backend.inference_server_id)
        state.route_marks.pop(handle.backend.inference_server_id, None)
        if not cluster.members:
            del state.clusters[cluster_id]
        if not state.clusters:
            del self._targets[target]
            return
        state.rebuild(target, membership_changed=True)

    def _report(self, targets: Iterable[Target]) -> None:
        if self._on_active_count is None:
            return
        for target in dict.fromkeys(targets):
            state = self._targets.get(target)
            count = 0 if state is None else state.active_count()
            self._on_active_count(target, count, target in self._advertised)


def _stats_json(stats: ModelStats) -> dict[str, object]:
    fields = {name: getattr(stats, name) for name in ModelStats.__dataclass_fields__}
    fields["queue_time_estimate_ms_by_priority"] = {
        str(priority): ms for priority, ms in sorted(stats.queue_time_estimate_ms_by_priority.items())
    }
    fields["stats_capabilities"] = list(stats.stats_capabilities)
    fields["stats_sources"] = list(stats.stats_sources)
    # Keys stay private: only how many.
    fields["recent_cache_affinity_routes"] = len(stats.recent_cache_affinity_routes)
    fields["prefilling_cache_affinity_keys"] = len(stats.prefilling_cache_affinity_keys)
    return fields
