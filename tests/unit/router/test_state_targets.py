"""Activation, advertised index, generations and model listing (spec §1.4, §1.6, §5.8; 81-85, 95-97)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from stargate.balancer.settings import Algorithm, AlgorithmDefinition, Placement
from stargate.balancer.types import AffinityRoute, LbRequest, ModelStats, Selected, Target
from stargate.errors import RequestError
from stargate.router.state import RegistrationHandle, RoutingState

MS = 1_000_000
T = Target(None, "model-a")


class Gauge:
    def __init__(self) -> None:
        self.values: dict[Target, int] = {}
        self.advertised: dict[Target, bool] = {}

    def __call__(self, target: Target, count: int, advertised: bool) -> None:
        self.values[target] = count
        self.advertised[target] = advertised


def make_state() -> tuple[RoutingState, Gauge]:
    gauge = Gauge()
    return RoutingState(clock=lambda: 5.0, on_active_count=gauge), gauge


def join(
    state: RoutingState, server_id: str, routing_key: str | None = None, cluster_id: str = ""
) -> RegistrationHandle:
    handle = state.admit(server_id, f"http://{server_id}:9000", cluster_id, routing_key)
    assert handle is not None
    return handle


def ids(state: RoutingState, target: Target = T) -> list[str]:
    view = state.view(target)
    return [] if view is None else [c.cluster_id for c in view.candidates]


def test_81_inactive_stops_routing_but_stays_advertised() -> None:
    state, gauge = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    assert ids(state) == ["a"]
    assert gauge.values[T] == 1
    state.apply_update(a, {"model-a": None}, MS)
    assert state.view(T) is None
    assert state.is_advertised(T)
    assert gauge.values[T] == 0
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    assert ids(state) == ["a"]


def test_the_gauge_callback_says_whether_a_registration_still_lists_the_target() -> None:
    """The metrics drop a target's series once none does; one in no routing but listed stays."""
    state, gauge = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": None}, MS)  # listed, not in routing
    assert (gauge.values[T], gauge.advertised[T]) == (0, True)
    state.remove(a)  # ended while not in routing: still reported
    assert (gauge.values[T], gauge.advertised[T]) == (0, False)
    b = join(state, "b")
    state.apply_update(b, {"model-a": ModelStats()}, MS)
    assert (gauge.values[T], gauge.advertised[T]) == (1, True)
    state.apply_update(b, {}, MS)
    assert (gauge.values[T], gauge.advertised[T]) == (0, False)


def test_83_active_without_rtt_is_not_routable_until_rtt_returns() -> None:
    state, _ = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats()}, None)
    assert state.view(T) is None and state.is_advertised(T)
    state.apply_update(a, {"model-a": ModelStats()}, 2 * MS)
    assert ids(state) == ["a"]
    state.apply_update(a, {"model-a": ModelStats()}, None)
    assert state.view(T) is None


def test_84_dropped_model_is_no_longer_a_candidate() -> None:
    state, gauge = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats(), "model-b": ModelStats()}, MS)
    state.apply_update(a, {"model-b": ModelStats()}, MS)
    assert state.view(T) is None
    assert not state.is_advertised(T)
    assert ids(state, Target(None, "model-b")) == ["a"]
    assert gauge.values[T] == 0


def test_85_stream_end_removes_routes_and_advertisement() -> None:
    state, gauge = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats(), "model-b": None}, MS)
    state.remove(a)
    assert state.view(T) is None
    assert not state.is_advertised(T) and not state.is_advertised(Target(None, "model-b"))
    assert not state.is_registered("a")
    assert gauge.values[T] == 0


def test_advertised_counts_every_live_registration() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    state.apply_update(a, {"model-a": None}, MS)
    state.apply_update(b, {"model-a": None}, MS)
    state.remove(a)
    assert state.is_advertised(T)
    state.apply_update(b, {}, MS)
    assert not state.is_advertised(T)


def test_97_duplicate_live_id_is_refused_and_first_keeps_routing() -> None:
    state, _ = make_state()
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    assert state.admit("a", "http://other:1", "", None) is None
    assert ids(state) == ["a"]


def test_stale_handle_never_touches_a_same_id_replacement() -> None:
    state, _ = make_state()
    old = join(state, "a")
    state.apply_update(old, {"model-a": ModelStats()}, MS)
    state.remove(old)
    new = join(state, "a")
    assert new.generation != old.generation
    state.apply_update(new, {"model-a": ModelStats(queue_size=4)}, MS)
    state.remove(old)
    assert not state.apply_update(old, {}, MS)
    view = state.view(T)
    assert view is not None and view.candidates[0].stats.queue_size == 4
    assert state.is_registered("a") and state.is_advertised(T)


def test_backend_live_reports_each_admission_and_end_once() -> None:
    seen: list[tuple[str, bool]] = []
    state = RoutingState(clock=lambda: 5.0, on_backend_live=lambda b, live: seen.append((b, live)))
    old = join(state, "a")
    assert state.admit("a", "http://other:1", "", None) is None  # refused: no report
    state.remove(old)
    new = join(state, "a")
    state.remove(old)  # a stale handle ends nothing
    state.remove(new)
    assert seen == [("a", True), ("a", False), ("a", True), ("a", False)]


def test_empty_cluster_id_means_the_server_id() -> None:
    state, _ = make_state()
    handle = join(state, "srv-1")
    assert handle.backend.cluster_id == "srv-1"
    assert join(state, "srv-2", cluster_id="rack").backend.cluster_id == "rack"


def test_cluster_is_scoped_by_routing_key() -> None:
    state, _ = make_state()
    keyed = join(state, "a", routing_key="rk", cluster_id="c")
    plain = join(state, "b", cluster_id="c")
    state.apply_update(keyed, {"model-a": ModelStats()}, MS)
    state.apply_update(plain, {"model-a": ModelStats()}, MS)
    keyed_view, plain_view = state.view(Target("rk", "model-a")), state.view(T)
    assert keyed_view is not None and plain_view is not None
    assert [c.active_backend_count for c in keyed_view.candidates] == [1]
    assert [b.inference_server_id for b in plain_view.backends("c")] == ["b"]


def test_policy_is_built_once_per_generation_and_definition() -> None:
    state, _ = make_state()
    definition = AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    other = AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    first = state.view(T)
    assert first is not None
    policy = first.policy(definition)
    state.apply_update(a, {"model-a": ModelStats(queue_size=1)}, MS)
    second = state.view(T)
    assert second is not None and second.generation == first.generation
    assert second.policy(definition) is policy
    assert second.policy(other) is not policy


def test_retired_target_gets_a_fresh_generation_and_policies() -> None:
    state, _ = make_state()
    definition = AlgorithmDefinition(Algorithm.ROUND_ROBIN)
    a = join(state, "a")
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    old = state.view(T)
    assert old is not None
    old_policy = old.policy(definition)
    assert old.pick_backend("a") is not None
    state.apply_update(a, {"model-a": None}, MS)
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    new = state.view(T)
    assert new is not None and new.generation != old.generation
    assert new.policy(definition) is not old_policy
    assert old.policy(definition) is old_policy
    assert [c.cluster_id for c in old.candidates] == ["a"]


def test_95_list_models_sorted_and_follows_backend_lifetime() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    state.apply_update(a, {"model-z": ModelStats()}, MS)
    state.apply_update(b, {"model-b": ModelStats(), "model-z": ModelStats(), "model-off": None}, MS)
    assert state.list_models(None) == ["model-b", "model-z"]
    state.remove(b)
    assert state.list_models(None) == ["model-z"]
    assert state.active_model_ids() == ["model-z"]


def test_96_list_models_by_routing_key_and_filters() -> None:
    state, _ = make_state()
    state.apply_update(join(state, "a", routing_key="rk-list-a"), {"model-a": ModelStats()}, MS)
    state.apply_update(join(state, "b", routing_key="rk-list-b"), {"model-b": ModelStats()}, MS)
    assert state.list_models(None) == []
    assert state.list_models("   ") == []
    assert state.list_models(" rk-list-a ") == ["model-a"]
    assert state.list_models("rk-unknown") == []
    assert state.list_models("rk-list-b", [" model-b ", "model-a", "model-b"]) == ["model-b"]
    assert state.active_model_ids() == ["model-a", "model-b"]
    with pytest.raises(RequestError, match="model_ids must not contain empty values"):
        state.list_models(None, ["model-a", " "])


class Learner:
    """A policy that records the routes it is handed."""

    def __init__(self, definition: AlgorithmDefinition) -> None:
        self.definition = definition
        self.learnt: list[tuple[str, str, float]] = []
        self.in_flight: list[bool] = []

    def decide(self, *_: object) -> None:
        raise AssertionError("not decided here")

    def learn_routes(
        self,
        cluster_id: str,
        routes: Sequence[AffinityRoute],
        offset_s: float,
        in_flight: Callable[[str], bool],
    ) -> None:
        for route in routes:
            at = round(route.admitted_at_unix_ms / 1000.0 + offset_s, 6)
            self.learnt.append((cluster_id, route.key, at))
            self.in_flight.append(in_flight(route.key))


def test_published_routes_reach_the_targets_policies_once_each_on_the_monotonic_clock() -> None:
    state = RoutingState(clock=lambda: 5.0, wall_clock=lambda: 1_000.0)
    a = join(state, "a", cluster_id="c1")
    state.apply_update(a, {"model-a": ModelStats()}, MS)
    view = state.view(T)
    assert view is not None
    definition = AlgorithmDefinition(Algorithm.WAIT_AND_WIDEN)
    learner = Learner(definition)
    view._policies[definition] = learner  # type: ignore[assignment]  # as a decision would have built
    reservation = state.reserve(T, "a", 10, 0, key="k2")  # this router's own request of k2
    first = (AffinityRoute("k1", 10, 999_000), AffinityRoute("k2", 10, 999_500))
    state.apply_update(a, {"model-a": ModelStats(recent_cache_affinity_routes=first)}, MS)
    state.finish(reservation)
    # The next heartbeat repeats the routes of the window: only the new one is handed on (the
    # newest known is handed again: routes of one millisecond may span two heartbeats).
    later = (*first, AffinityRoute("k3", 10, 999_900))
    state.apply_update(a, {"model-a": ModelStats(recent_cache_affinity_routes=later)}, MS)
    assert learner.learnt == [
        ("c1", "k1", 4.0),
        ("c1", "k2", 4.5),
        ("c1", "k2", 4.5),
        ("c1", "k3", 4.9),
    ]
    assert learner.in_flight == [False, True, False, False]  # k2 in flight here until it finished


def test_a_policy_built_after_routes_were_published_learns_them_at_once() -> None:
    state = RoutingState(clock=lambda: 5.0, wall_clock=lambda: 1_000.0)
    a, b = join(state, "a", cluster_id="c1"), join(state, "b", cluster_id="c2")
    state.apply_update(a, {"model-a": ModelStats(last_mean_input_tps=1000.0)}, MS)
    routes = (AffinityRoute("session", 100, 999_000),)  # another router sent it to c2 a second ago
    published = ModelStats(last_mean_input_tps=1000.0, recent_cache_affinity_routes=routes)
    state.apply_update(b, {"model-a": published}, MS)
    view = state.view(T)
    assert view is not None
    definition = AlgorithmDefinition(
        Algorithm.WAIT_AND_WIDEN,
        selection_count=1,
        load_aware=True,
        cache_affinity_yield_margin_ms=1000,
        cache_affinity_placement=Placement.LOAD,
    )
    policy = view.policy(definition)
    request = LbRequest(T, input_tokens=100, received_at=5.0, now=5.0, cache_affinity_key="session")
    for seed in range(8):
        decision = policy.decide(view.candidates, request, random.Random(seed))
        assert isinstance(decision, Selected)
        assert view.candidates[decision.choice.index].cluster_id == "c2"
