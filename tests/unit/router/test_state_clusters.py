"""Cluster aggregation, backend choice and reservations (spec §1.8, §1.9, §1.11; conformance 86-94)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import MappingProxyType

from stargate.balancer.estimates import expected_queue_ms
from stargate.balancer.types import Candidate, ModelStats, Target
from stargate.router.state import (
    SERVER_ERROR_HOLD_S,
    SERVER_ERRORS_IN_A_ROW,
    RegistrationHandle,
    RoutingState,
)
from stargate.wire.proto import CACHED_PROMPT_WORK

MS = 1_000_000  # ns per ms
T = Target(None, "model-a")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pmap(**entries: int) -> MappingProxyType[int, int]:
    return MappingProxyType({int(k[1:]): v for k, v in entries.items()})


def make_state() -> tuple[RoutingState, Clock]:
    clock = Clock()
    return RoutingState(clock=clock), clock


def join(state: RoutingState, server_id: str, cluster_id: str = "c1") -> RegistrationHandle:
    handle = state.admit(server_id, f"http://{server_id}:9000", cluster_id, None)
    assert handle is not None
    return handle


def publish(state: RoutingState, handle: RegistrationHandle, stats: ModelStats, rtt_ms: float = 1.0) -> None:
    assert state.apply_update(handle, {"model-a": stats}, int(rtt_ms * MS))


def only_candidate(state: RoutingState) -> Candidate:
    view = state.view(T)
    assert view is not None
    (candidate,) = view.candidates
    return candidate


STATS_A = ModelStats(
    last_mean_input_tps=100.0,
    queued_input_size=100,
    queue_size=1,
    num_running_queries=11,
    max_engine_concurrency=111,
    queue_time_estimate_ms_by_priority=pmap(p1=111),
)
STATS_B = ModelStats(
    last_mean_input_tps=120.0,
    queued_input_size=200,
    queue_size=2,
    num_running_queries=7,
    max_engine_concurrency=77,
    queue_time_estimate_ms_by_priority=pmap(p1=222, p2=333),
)


def test_86_cluster_sums_load_and_copies_latest_publisher() -> None:
    state, clock = make_state()
    a, b = join(state, "a"), join(state, "b")
    publish(state, a, STATS_A, rtt_ms=10)
    clock.now += 1
    publish(state, b, STATS_B, rtt_ms=5)
    candidate = only_candidate(state)
    assert candidate.cluster_id == "c1"
    assert candidate.stats.last_mean_input_tps == 220.0
    assert candidate.stats.queued_input_size == 300
    assert candidate.stats.queue_size == 3
    assert candidate.stats.num_running_queries == 7
    assert candidate.stats.max_engine_concurrency == 77
    assert dict(candidate.stats.queue_time_estimate_ms_by_priority) == {1: 222, 2: 333}
    assert candidate.rtt_s == 0.0075
    assert candidate.active_backend_count == 2
    assert candidate.updated_at == 101.0


def test_87_source_falls_back_to_remaining_backend_when_publisher_leaves() -> None:
    state, clock = make_state()
    a, b = join(state, "a"), join(state, "b")
    publish(state, a, STATS_A, rtt_ms=10)
    clock.now += 1
    publish(state, b, STATS_B, rtt_ms=5)
    state.remove(b)
    candidate = only_candidate(state)
    assert candidate.stats.last_mean_input_tps == 100.0
    assert candidate.stats.num_running_queries == 11
    assert candidate.stats.max_engine_concurrency == 111
    assert candidate.rtt_s == 0.010
    assert candidate.active_backend_count == 1


def test_88_rtt_is_integer_nanosecond_mean_per_cluster() -> None:
    state, _ = make_state()
    for server_id, cluster_id, rtt_ms in (("a", "c1", 1), ("b", "c1", 101), ("c", "c2", 20), ("d", "c2", 20)):
        publish(state, join(state, server_id, cluster_id), ModelStats(), rtt_ms=rtt_ms)
    view = state.view(T)
    assert view is not None
    assert {c.cluster_id: c.rtt_s for c in view.candidates} == {"c1": 0.051, "c2": 0.020}


def test_rtt_mean_truncates_toward_zero() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    assert state.apply_update(a, {"model-a": ModelStats()}, 8 * MS)
    assert state.apply_update(b, {"model-a": ModelStats()}, 5 * MS + 1)
    assert only_candidate(state).rtt_s == 6_500_000 / 1e9


def test_invalid_tps_is_not_summed_and_observed_time_is_max() -> None:
    state, _ = make_state()
    a, b, c = join(state, "a"), join(state, "b"), join(state, "c")
    nan = float("nan")
    publish(state, a, ModelStats(last_mean_input_tps=nan, output_tps=3.0, stats_observed_at_unix_ms=7))
    publish(state, b, ModelStats(last_mean_input_tps=-5.0, output_tps=4.0, stats_observed_at_unix_ms=9))
    publish(state, c, ModelStats(last_mean_input_tps=50.0, stats_observed_at_unix_ms=8))
    stats = only_candidate(state).stats
    assert stats.last_mean_input_tps == 50.0
    assert stats.output_tps == 7.0
    assert stats.stats_observed_at_unix_ms == 9


def test_labels_are_unioned_in_backend_id_order() -> None:
    state, _ = make_state()
    b, a = join(state, "b"), join(state, "a")
    publish(state, b, ModelStats(stats_capabilities=("kv", "z"), stats_sources=("engine",)))
    publish(state, a, ModelStats(stats_capabilities=("z", "q"), stats_sources=("pylon", "engine")))
    stats = only_candidate(state).stats
    assert stats.stats_capabilities == ("z", "q", "kv")
    assert stats.stats_sources == ("pylon", "engine")


def test_previous_source_is_kept_when_another_member_leaves() -> None:
    state, clock = make_state()
    a, b, c = join(state, "a"), join(state, "b"), join(state, "c")
    publish(state, a, ModelStats(num_running_queries=1))
    clock.now += 1
    publish(state, c, ModelStats(num_running_queries=3))
    clock.now += 1
    publish(state, b, ModelStats(num_running_queries=2))
    state.remove(c)
    assert only_candidate(state).stats.num_running_queries == 2
    state.remove(b)
    assert only_candidate(state).stats.num_running_queries == 1


def test_greatest_update_time_becomes_source_when_source_leaves() -> None:
    state, clock = make_state()
    a, b, c = join(state, "a"), join(state, "b"), join(state, "c")
    publish(state, b, ModelStats(num_running_queries=2))
    clock.now += 1
    publish(state, a, ModelStats(num_running_queries=1))
    clock.now += 1
    publish(state, c, ModelStats(num_running_queries=3))
    state.remove(c)
    assert only_candidate(state).stats.num_running_queries == 1


def test_90_backend_round_robin_skips_failed_backends() -> None:
    state, _ = make_state()
    for server_id in ("c", "a", "b"):
        publish(state, join(state, server_id), ModelStats())
    view = state.view(T)
    assert view is not None
    picks = [view.pick_backend("c1") for _ in range(3)]
    assert [p.inference_server_id for p in picks if p] == ["a", "b", "c"]
    failed = frozenset({"a"})
    picks = [view.pick_backend("c1", failed) for _ in range(2)]
    assert [p.inference_server_id for p in picks if p] == ["c", "b"]
    assert view.pick_backend("c1", frozenset({"a", "b", "c"})) is None
    assert view.pick_backend("unknown") is None
    backend = view.pick_backend("c1")
    assert backend is not None and backend.url == f"http://{backend.inference_server_id}:9000"


def test_backend_counter_is_shared_across_views_of_one_generation() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    publish(state, a, ModelStats())
    publish(state, b, ModelStats())
    first = state.view(T)
    assert first is not None
    assert first.pick_backend("c1") is not None
    publish(state, a, ModelStats(queue_size=1))
    second = state.view(T)
    assert second is not None and second is not first
    picked = second.pick_backend("c1")
    assert picked is not None and picked.inference_server_id == "b"


def test_91_reservation_applies_until_the_backends_next_heartbeat() -> None:
    state, _ = make_state()
    a = join(state, "a")
    published = ModelStats(last_mean_input_tps=100.0, queue_time_estimate_ms_by_priority=pmap(p4=5))
    publish(state, a, published)
    state.reserve(T, "a", 37, 4)
    stats = only_candidate(state).stats
    assert (stats.num_running_queries, stats.queue_size) == (1, 1)
    assert (stats.queued_input_size, stats.total_query_input_size) == (37, 37)
    assert dict(stats.queue_time_estimate_ms_by_priority) == {4: 375}
    assert stats.last_mean_input_tps == 100.0
    publish(state, a, published)
    assert only_candidate(state).stats == published


def test_92_releasing_one_reservation_removes_only_its_contribution() -> None:
    state, _ = make_state()
    publish(state, join(state, "a"), ModelStats(last_mean_input_tps=100.0))
    first = state.reserve(T, "a", 10, 0)
    state.reserve(T, "a", 20, 0)
    state.release(first)
    stats = only_candidate(state).stats
    assert (stats.queue_size, stats.queued_input_size, stats.num_running_queries) == (1, 20, 1)
    state.release(first)
    assert only_candidate(state).stats.queued_input_size == 20


def test_93_other_backends_heartbeat_keeps_reservation() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    stats = ModelStats(last_mean_input_tps=100.0, queue_time_estimate_ms_by_priority=pmap(p4=5))
    publish(state, a, stats)
    publish(state, b, stats)
    state.reserve(T, "a", 37, 4)
    publish(state, b, stats)
    candidate = only_candidate(state)
    assert dict(candidate.stats.queue_time_estimate_ms_by_priority) == {4: 190}
    assert candidate.stats.queue_size == 1


def test_94_priority_map_bump_and_clear_without_tps() -> None:
    state, _ = make_state()
    a = join(state, "a")
    estimates = pmap(p1=10, p2=100, p4=400)
    publish(state, a, ModelStats(last_mean_input_tps=100.0, queue_time_estimate_ms_by_priority=estimates))
    state.reserve(T, "a", 10, 2)
    assert dict(only_candidate(state).stats.queue_time_estimate_ms_by_priority) == {1: 10, 2: 200, 4: 500}
    publish(state, a, ModelStats(last_mean_input_tps=0.0, queue_time_estimate_ms_by_priority=estimates))
    state.reserve(T, "a", 10, 2)
    assert dict(only_candidate(state).stats.queue_time_estimate_ms_by_priority) == {}


def test_reservation_ends_when_backend_leaves_cluster() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    publish(state, a, ModelStats())
    publish(state, b, ModelStats())
    state.reserve(T, "a", 5, 0)
    state.reserve(T, "b", 7, 0)
    state.remove(a)
    assert only_candidate(state).stats.queued_input_size == 7


def test_reservation_for_unknown_backend_or_target_is_inert() -> None:
    state, _ = make_state()
    publish(state, join(state, "a"), ModelStats())
    before = state.view(T)
    ghost = state.reserve(T, "ghost", 5, 0)
    missing = state.reserve(Target(None, "other"), "a", 5, 0)
    assert state.view(T) is before
    state.release(ghost)
    state.release(missing)
    assert only_candidate(state).stats.queue_size == 0


def test_view_is_shared_until_a_mutation() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats())
    first = state.view(T)
    assert first is not None
    assert state.view(T) is first
    reservation = state.reserve(T, "a", 1, 0)
    reserved = state.view(T)
    assert reserved is not first and reserved is not None
    assert first.candidates[0].stats.queue_size == 0
    assert reserved.candidates[0].stats.queue_size == 1
    state.release(reservation)
    released = state.view(T)
    assert released is not None and released.candidates[0].stats.queue_size == 0


# ---- the router's own in-flight count and reservation end (load-aware routing) -------------------


def test_in_flight_counts_prefill_until_first_byte_and_requests_until_finish() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    first = state.reserve(T, "a", 300, 0)
    second = state.reserve(T, "a", 200, 0)
    flight = only_candidate(state).in_flight
    assert (flight.requests, flight.prefilling, flight.prefill_tokens) == (2, 2, 500)
    state.first_byte(first)
    state.first_byte(first)  # a second mark changes nothing
    flight = only_candidate(state).in_flight
    assert (flight.requests, flight.prefilling, flight.prefill_tokens, flight.decoding) == (2, 1, 200, 1)
    state.finish(first)
    state.finish(second)
    state.finish(second)
    flight = only_candidate(state).in_flight
    assert (flight.requests, flight.prefilling, flight.prefill_tokens) == (0, 0, 0)


def test_a_first_byte_before_the_first_token_keeps_the_prefill_in_flight() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    reservation = state.reserve(T, "a", 300, 0)
    state.first_byte(reservation, prefilled=False)  # ``response.created``, before the prefill
    flight = only_candidate(state).in_flight
    assert (flight.prefilling, flight.prefill_tokens, flight.decoding) == (1, 300, 0)
    assert state.answered_within("a", 1.0)
    state.prefilled(reservation)
    flight = only_candidate(state).in_flight
    assert (flight.prefilling, flight.prefill_tokens, flight.decoding) == (0, 0, 1)
    state.finish(reservation)
    state.prefilled(reservation)  # after its end: nothing to change
    assert only_candidate(state).in_flight.requests == 0


def test_in_flight_names_the_keys_still_prefilling_and_counts_each_keys_requests() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    first = state.reserve(T, "a", 300, 0, key="k")
    second = state.reserve(T, "a", 200, 0, key="k")
    other = state.reserve(T, "a", 100, 0, key="j")
    state.reserve(T, "a", 100, 0)
    assert only_candidate(state).in_flight.prefilling_keys == {"k", "j"}
    assert only_candidate(state).in_flight.keys == {"k": 2, "j": 1}
    state.first_byte(first)
    assert only_candidate(state).in_flight.prefilling_keys == {"k", "j"}  # the second still prefills
    assert only_candidate(state).in_flight.keys == {"k": 2, "j": 1}  # decoding is in flight too
    state.finish(second)  # ended before its first byte (an error, a cancel)
    state.first_byte(other)
    state.first_byte(other)
    assert only_candidate(state).in_flight.prefilling_keys == frozenset()
    assert only_candidate(state).in_flight.keys == {"k": 1, "j": 1}
    state.finish(first)
    state.finish(other)
    assert only_candidate(state).in_flight.prefilling_keys == frozenset()
    assert only_candidate(state).in_flight.keys == {}


def test_measured_prefill_rate_is_tokens_per_second_of_time_a_whole_prompt_prefilled() -> None:
    """Two prompts prefilling side by side share the time: the rate is the engine's, not a share."""
    state, clock = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    assert only_candidate(state).measured_input_tps == 0.0  # nothing measured yet
    first = state.reserve(T, "a", 3000, 0)
    second = state.reserve(T, "a", 1000, 0)
    clock.now += 0.5
    state.first_byte(second)  # 1000 tokens in 0.5 s of busy time: short of a sample
    assert only_candidate(state).measured_input_tps == 0.0
    clock.now += 0.5
    state.first_byte(first)  # 4000 tokens in 1.0 s
    assert only_candidate(state).measured_input_tps == 4000.0
    clock.now += 10.0  # idle: no prefill in flight, no time counted
    cached = state.reserve(T, "a", 5000, 0, prefill_tokens=100)  # expected mostly cached: not measured
    clock.now += 0.5
    state.first_byte(cached)
    third = state.reserve(T, "a", 1000, 0)
    clock.now += 0.25
    state.finish(third)  # ended before its first byte: its time counts, no tokens
    fourth = state.reserve(T, "a", 500, 0)
    clock.now += 0.75
    state.first_byte(fourth)  # 500 tokens in 1.0 s: samples 4000 and 500, the lower median
    assert only_candidate(state).measured_input_tps == 500.0
    assert only_candidate(state).stats.last_mean_input_tps == 100.0  # the published mean is kept


def test_one_absurd_claim_does_not_move_the_measured_rate() -> None:
    state, clock = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))

    def sample(tokens: int) -> None:
        reservation = state.reserve(T, "a", tokens, 0)
        clock.now += 1.0
        state.first_byte(reservation)
        state.finish(reservation)

    sample(2000)
    sample(2000)
    sample(10_000_000)  # 10^7 tok/s: a claim no prompt of a real request makes in one second
    assert only_candidate(state).measured_input_tps == 2000.0  # the median of three
    sample(1 << 25)  # past every context window: not counted at all
    assert only_candidate(state).measured_input_tps == 2000.0


def test_measured_slot_time_is_the_mean_from_dispatch_to_end_of_requests_sent_to_a_free_slot() -> None:
    state, clock = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=2))
    assert only_candidate(state).measured_slot_s == 0.0
    first = state.reserve(T, "a", 100, 0)
    second = state.reserve(T, "a", 100, 0)
    queued = state.reserve(T, "a", 100, 0)  # both slots taken: its time includes a wait
    clock.now += 1.0
    state.first_byte(first)
    state.first_byte(second)
    state.first_byte(queued)
    clock.now += 2.0
    state.finish(first)
    assert only_candidate(state).measured_slot_s == 3.0
    failed = state.reserve(T, "a", 100, 0)
    clock.now += 1.0
    state.finish(failed)  # no answer: not a slot's time
    state.finish(queued)
    clock.now += 2.0
    state.finish(second)
    assert only_candidate(state).measured_slot_s == 4.5  # the mean of 3 s and 6 s


def test_an_answer_refused_at_once_measures_neither_the_prefill_rate_nor_a_slots_time() -> None:
    """A ten-million-token prompt the engine refused (400) read as 24 million tokens/s prefilled,
    and refusals took the mean slot time from 925 ms to 133 ms."""
    state, clock = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=2))

    def request(tokens: int, ran: bool) -> None:
        reservation = state.reserve(T, "a", tokens, 0)
        clock.now += 1.0 if ran else 0.1
        state.first_byte(reservation, ran=ran)
        clock.now += 1.0 if ran else 0.0
        state.finish(reservation)

    request(2000, ran=True)
    request(2000, ran=True)
    for _ in range(40):  # 4 s of refusals: samples enough to move the median
        request(1_000_000, ran=False)
    assert only_candidate(state).measured_input_tps == 2000.0
    assert only_candidate(state).measured_slot_s == 2.0


def test_until_a_request_ends_the_oldest_one_holding_a_slot_says_since_when() -> None:
    state, clock = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=1))
    assert only_candidate(state).slot_held_since == math.inf
    start = clock.now
    first = state.reserve(T, "a", 100, 0)
    clock.now += 1.0
    queued = state.reserve(T, "a", 100, 0)  # no free slot: not known when it got one
    assert only_candidate(state).slot_held_since == start
    state.first_byte(first)
    state.finish(first)  # now measured: the measure speaks instead
    assert only_candidate(state).measured_slot_s == 1.0
    assert only_candidate(state).slot_held_since == math.inf
    state.finish(queued)


def test_keys_prefilling_are_the_members_published_ones_less_this_routers_that_left_prefill() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    stats = ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8)
    publish(state, a, stats)
    own = state.reserve(T, "a", 100, 0, key="mine")
    publish(state, a, replace(stats, prefilling_cache_affinity_keys=frozenset({"mine", "other-a"})))
    publish(state, b, replace(stats, prefilling_cache_affinity_keys=frozenset({"other-b"})))
    assert only_candidate(state).stats.prefilling_cache_affinity_keys == {"mine", "other-a", "other-b"}
    (described,) = state.describe()
    assert json.loads(json.dumps(described))["clusters"][0]["stats"]["prefilling_cache_affinity_keys"] == 3
    state.first_byte(own)  # the heartbeat counted it prefilling: its key leaves with it
    assert only_candidate(state).stats.prefilling_cache_affinity_keys == {"other-a", "other-b"}
    publish(state, a, replace(stats, prefilling_cache_affinity_keys=frozenset({"other-a"})))
    assert only_candidate(state).stats.prefilling_cache_affinity_keys == {"other-a", "other-b"}
    state.finish(own)


def test_in_flight_survives_heartbeats_that_end_the_reservation() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    state.reserve(T, "a", 300, 0)
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8, num_running_queries=1))
    candidate = only_candidate(state)
    assert candidate.stats.num_running_queries == 1  # the heartbeat counted it; reservation gone
    assert candidate.in_flight.requests == 1


def test_finishing_a_request_ends_its_pending_reservation() -> None:
    """Reservations of finished requests must not make a cluster look full until the next heartbeat."""
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    reservation = state.reserve(T, "a", 37, 0)
    assert only_candidate(state).stats.num_running_queries == 1
    state.finish(reservation)
    candidate = only_candidate(state)
    assert candidate.stats.num_running_queries == 0
    assert candidate.stats.queued_input_size == 0


def test_release_ends_only_the_reservation_and_leaving_ends_the_in_flight_record() -> None:
    state, _ = make_state()
    a, b = join(state, "a"), join(state, "b")
    stats = ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8)
    publish(state, a, stats)
    publish(state, b, stats)
    on_a = state.reserve(T, "a", 10, 0)
    state.reserve(T, "b", 20, 0)
    state.release(on_a)
    assert only_candidate(state).in_flight.requests == 2
    state.remove(a)
    assert only_candidate(state).in_flight.prefill_tokens == 20
    state.finish(on_a)  # already gone with its backend: no effect
    assert only_candidate(state).in_flight.requests == 1


def test_requests_that_end_after_a_heartbeat_counted_them_leave_its_stale_counts() -> None:
    """A heartbeat counts what ran when the backend published; a request of ours it counted that
    has ended since is subtracted until the next heartbeat (no lagging 'full' cluster)."""
    state, _ = make_state()
    a = join(state, "a")
    idle = ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=2)
    publish(state, a, idle)
    first = state.reserve(T, "a", 30, 0)
    second = state.reserve(T, "a", 20, 0)
    busy = ModelStats(
        last_mean_input_tps=100.0,
        max_engine_concurrency=2,
        num_running_queries=2,
        queue_size=2,
        queued_input_size=50,
        total_query_input_size=50,
    )
    publish(state, a, busy)
    state.first_byte(first)
    stats = only_candidate(state).stats
    assert (stats.num_running_queries, stats.queue_size, stats.queued_input_size) == (2, 1, 20)
    state.finish(first)
    state.finish(second)
    stats = only_candidate(state).stats
    assert (stats.num_running_queries, stats.queue_size, stats.queued_input_size) == (0, 0, 0)
    assert stats.total_query_input_size == 0
    publish(state, a, busy)  # the next heartbeat is taken as published again
    assert only_candidate(state).stats.num_running_queries == 2


def test_requests_started_after_the_heartbeat_are_not_subtracted_when_they_end() -> None:
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=4, num_running_queries=3))
    late = state.reserve(T, "a", 10, 0)
    assert only_candidate(state).stats.num_running_queries == 4  # 3 published + 1 reservation
    state.finish(late)
    assert only_candidate(state).stats.num_running_queries == 3


def test_a_pick_that_expects_its_prefix_cached_counts_only_the_uncached_prefill() -> None:
    """Load-aware affinity picks expect most of the prompt cached: the router's in-flight work and
    pending reservation count the uncached part, and a heartbeat (which counts the whole prompt) is
    credited the cached part while the request prefills."""
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    cached = state.reserve(T, "a", 1000, 0, prefill_tokens=200)
    full = state.reserve(T, "a", 300, 0)
    candidate = only_candidate(state)
    assert candidate.in_flight.prefill_tokens == 500
    assert candidate.stats.queued_input_size == 500  # the pending reservations
    published = ModelStats(
        last_mean_input_tps=100.0, max_engine_concurrency=8, num_running_queries=2, queued_input_size=1300
    )
    publish(state, a, published)
    assert only_candidate(state).stats.queued_input_size == 500  # 1300 - 800 cached
    state.first_byte(cached)
    assert only_candidate(state).stats.queued_input_size == 300  # all of its 1000 out now
    state.finish(full)
    assert only_candidate(state).stats.queued_input_size == 0
    state.finish(cached)
    assert only_candidate(state).in_flight.prefill_tokens == 0
    publish(state, a, published)  # the next heartbeat: no request of ours is prefilling any more
    assert only_candidate(state).stats.queued_input_size == 1300


def test_the_in_flight_record_keeps_the_size_of_each_prompt_prefilling() -> None:
    """Processor-sharing estimates need each prompt's size, not only their sum."""
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    long = state.reserve(T, "a", 900, 0)
    cached = state.reserve(T, "a", 1000, 0, prefill_tokens=200)
    short = state.reserve(T, "a", 200, 0)
    assert only_candidate(state).in_flight.prefill_sizes == (200, 200, 900)
    state.first_byte(cached)
    assert only_candidate(state).in_flight.prefill_sizes == (200, 900)
    state.finish(long)
    state.finish(cached)  # decoding: no size left to remove
    assert only_candidate(state).in_flight.prefill_sizes == (200,)
    state.finish(short)
    assert only_candidate(state).in_flight.prefill_sizes == ()


def test_a_pylon_that_leaves_the_cache_out_is_credited_nothing_more() -> None:
    """A Pylon with --engine-prefix-caching publishes the uncached work itself (its capability says
    so): the router credits no expected cache hit on top, and a first byte takes out what was left."""
    state, _ = make_state()
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0, max_engine_concurrency=8))
    cached = state.reserve(T, "a", 1000, 0, prefill_tokens=200)
    full = state.reserve(T, "a", 300, 0)
    published = ModelStats(
        last_mean_input_tps=100.0,
        max_engine_concurrency=8,
        num_running_queries=2,
        queued_input_size=500,  # 200 uncached + 300
        stats_capabilities=(CACHED_PROMPT_WORK,),
    )
    publish(state, a, published)
    assert only_candidate(state).stats.queued_input_size == 500
    state.first_byte(cached)
    assert only_candidate(state).stats.queued_input_size == 300
    state.finish(full)
    assert only_candidate(state).stats.queued_input_size == 0


def test_the_spec_checks_count_a_pick_expected_cached_as_its_whole_prompt() -> None:
    """Spec §3.10: queued work, reservations and the expected-queue header are never scaled. The
    ranking counts the uncached part of a pick expected cached; admission, the queue-SLO filter and
    the header read ``checked_stats`` and count the whole prompt, as Pylon does: a follow-up sent
    behind it expected 100 ms where Pylon counted 1000 and rejected it (queue_estimate_mismatch)."""
    state, _ = make_state()
    a = join(state, "a")
    published = ModelStats(
        last_mean_input_tps=1000.0, max_engine_concurrency=1, queue_time_estimate_ms_by_priority=pmap(p0=5)
    )
    publish(state, a, published)
    first = state.reserve(T, "a", 1000, 0, prefill_tokens=100)
    candidate = only_candidate(state)
    assert candidate.stats.queued_input_size == 100 and candidate.in_flight.prefill_tokens == 100
    assert candidate.stats.queue_time_estimate_ms_by_priority == {0: 105}
    checked = candidate.checked_stats
    assert checked.queued_input_size == 1000 and checked.queue_time_estimate_ms_by_priority == {0: 1005}
    assert checked.num_running_queries == candidate.stats.num_running_queries == 1
    assert candidate.in_flight.cached_tokens == 900
    assert expected_queue_ms(candidate, 0) == expected_queue_ms(candidate, 0, load_aware=True) == 1005
    whole = state.reserve(T, "a", 300, 0)  # a pick expected uncached counts alike in both
    candidate = only_candidate(state)
    assert (candidate.stats.queued_input_size, candidate.checked_stats.queued_input_size) == (400, 1300)
    state.finish(first)
    candidate = only_candidate(state)
    assert candidate.pylon_stats is None and candidate.in_flight.cached_tokens == 0
    assert candidate.checked_stats.queued_input_size == 300
    state.finish(whole)
    # Counted by a heartbeat without a priority map, the cached part is credited to the ranking;
    # this router's own count still has the header count the whole prompt.
    first = state.reserve(T, "a", 1000, 0, prefill_tokens=100)
    counted = ModelStats(
        last_mean_input_tps=1000.0, max_engine_concurrency=1, num_running_queries=1, queued_input_size=1000
    )
    publish(state, a, counted)
    candidate = only_candidate(state)
    assert candidate.stats.queued_input_size == 100 and candidate.in_flight.cached_tokens == 900
    assert expected_queue_ms(candidate, 0, load_aware=True) == 1000
    state.first_byte(first)
    assert only_candidate(state).in_flight.cached_tokens == 0


def test_a_pylon_that_leaves_the_cache_out_is_checked_with_the_uncached_work() -> None:
    """With CACHED_PROMPT_WORK Pylon counts only the uncached work itself: so does the header."""
    state, _ = make_state()
    a = join(state, "a")
    publish(
        state,
        a,
        ModelStats(
            last_mean_input_tps=1000.0, max_engine_concurrency=1, stats_capabilities=(CACHED_PROMPT_WORK,)
        ),
    )
    state.reserve(T, "a", 1000, 0, prefill_tokens=100)
    candidate = only_candidate(state)
    assert candidate.pylon_stats is None and candidate.in_flight.cached_tokens == 0
    assert candidate.checked_stats.queued_input_size == 100
    assert expected_queue_ms(candidate, 0) == expected_queue_ms(candidate, 0, load_aware=True) == 100


def test_a_backend_answers_from_a_first_response_byte_until_the_window_passes_or_it_leaves() -> None:
    state, clock = make_state()
    a, b = join(state, "a"), join(state, "b")
    publish(state, a, ModelStats())
    publish(state, b, ModelStats())
    reservation = state.reserve(T, "a", 10, 0)
    assert not state.answered_within("a", 1.5)  # sent, not answered
    clock.now += 10.0
    state.first_byte(reservation)
    clock.now += 1.5
    assert state.answered_within("a", 1.5) and not state.answered_within("b", 1.5)
    clock.now += 0.1
    assert not state.answered_within("a", 1.5)
    state.first_byte(state.reserve(T, "a", 10, 0), answered=False)  # a 5xx: no sign of life
    assert not state.answered_within("a", 1.5)
    state.first_byte(state.reserve(T, "a", 10, 0))
    state.remove(a)
    assert not state.answered_within("a", 1.5)


def test_the_state_is_starting_for_its_first_ten_seconds() -> None:
    state, clock = make_state()
    assert state.starting
    clock.now += 9.9
    assert state.starting
    clock.now += 0.1
    assert not state.starting


def test_a_backend_is_routable_while_it_serves_a_model_with_an_rtt() -> None:
    state, _ = make_state()
    a = join(state, "a")
    assert not state.is_routable("a")  # registered, no update yet
    publish(state, a, ModelStats())
    assert state.is_routable("a")
    assert state.apply_update(a, {"model-a": ModelStats()}, None)  # its health probes failed
    assert not state.is_routable("a")
    publish(state, a, ModelStats())
    state.remove(a)
    assert not state.is_routable("a") and not state.is_routable("never")


def test_a_registration_that_took_a_hung_ones_id_does_not_make_the_old_address_routable() -> None:
    state, _ = make_state()
    old = join(state, "a")
    publish(state, old, ModelStats())
    assert state.is_routable("a", "http://a:9000")
    state.remove(old)  # replaced: the new registration is at another address
    new = state.admit("a", "http://a-2:9000", "c1", None)
    assert new is not None
    publish(state, new, ModelStats())
    assert state.is_routable("a", "http://a-2:9000") and state.is_routable("a")
    assert not state.is_routable("a", "http://a:9000")  # a request still out to the old one


def test_server_errors_in_a_row_are_reported_once_while_another_backend_serves() -> None:
    state, _ = make_state()
    reported: list[tuple[str, int]] = []
    state.on_server_errors = lambda backend_id, _model_id, errors: reported.append((backend_id, errors))
    a = join(state, "a")
    publish(state, a, ModelStats(last_mean_input_tps=100.0))

    def answers(backend_id: str, *server_errors: bool) -> None:
        for error in server_errors:
            reservation = state.reserve(T, backend_id, 10, 0)
            state.first_byte(reservation)  # an answer began: its end tells
            if error:
                state.server_error(reservation)
            else:
                state.answered(reservation)
            state.finish(reservation)

    answers("a", *[True] * SERVER_ERRORS_IN_A_ROW, False)
    assert reported == []  # the only backend of its model stays: nothing better to send to
    b = join(state, "b", cluster_id="c2")
    publish(state, b, ModelStats(last_mean_input_tps=100.0))
    answers("a", *[True] * (SERVER_ERRORS_IN_A_ROW - 1), False, True)  # an answer resets the count
    assert reported == []
    answers("a", *[True] * SERVER_ERRORS_IN_A_ROW)
    assert reported == [("a", SERVER_ERRORS_IN_A_ROW)]
    answers("a", True)
    assert len(reported) == 1  # counted again from zero


def test_failures_of_a_backend_out_of_routing_are_not_counted() -> None:
    """The router gives up on its requests there itself: that must not extend its time out."""
    state, _ = make_state()
    reported: list[str] = []
    state.on_server_errors = lambda backend_id, _model_id, _errors: reported.append(backend_id)
    a, b = join(state, "a"), join(state, "b", cluster_id="c2")
    for handle in (a, b):
        publish(state, handle, ModelStats(last_mean_input_tps=100.0))
    state.apply_update(a, {"model-a": None}, None)  # its probes took it out
    for _ in range(SERVER_ERRORS_IN_A_ROW):
        state.server_error(state.reserve(T, "a", 10, 0))
    publish(state, a, ModelStats(last_mean_input_tps=100.0))
    state.server_error(state.reserve(T, "a", 10, 0))
    assert reported == []
    for _ in range(SERVER_ERRORS_IN_A_ROW - 1):
        state.server_error(state.reserve(T, "a", 10, 0))
    assert reported == ["a"]


def test_server_errors_hold_out_at_most_a_tenth_of_a_models_backends_at_least_one() -> None:
    state, clock = make_state()
    reported: list[str] = []
    state.on_server_errors = lambda backend_id, _model_id, _errors: reported.append(backend_id)
    names = [f"b{i}" for i in range(20)]
    handles = {name: join(state, name, cluster_id=name) for name in names}
    for handle in handles.values():
        publish(state, handle, ModelStats(last_mean_input_tps=100.0))

    def fail(backend_id: str) -> None:
        for _ in range(SERVER_ERRORS_IN_A_ROW):
            reservation = state.reserve(T, backend_id, 10, 0)
            state.server_error(reservation)
            state.finish(reservation)

    for name in names[:4]:
        fail(name)
    assert reported == ["b0", "b1"]  # 2 of 20 held; b2 and b3 stay in routing
    for name in names[2:]:
        state.remove(handles[name])  # 2 backends left: b0 and b1, both held
    assert state.view(T) is None  # both out of routing for the model
    clock.now += SERVER_ERROR_HOLD_S
    for name in names[:2]:
        state.apply_update(handles[name], {"model-a": ModelStats(last_mean_input_tps=100.0)}, MS)
    fail("b0")
    assert reported == ["b0", "b1", "b0"]  # the holds ended: one of the two may go again
    fail("b1")
    assert reported == ["b0", "b1", "b0"]  # never a second of two, whatever its answers


def test_server_errors_hold_a_backend_out_of_routing_for_the_failing_model_only() -> None:
    """An engine fails one model's requests while it serves others: that model leaves routing on
    it, the others stay, also one nobody else serves; and the model comes back with the first
    update after the hold."""
    state, clock = make_state()
    reported: list[tuple[str, str]] = []
    state.on_server_errors = lambda backend_id, model_id, _errors: reported.append((backend_id, model_id))
    only_a, shared = Target(None, "only-a"), Target(None, "shared")
    stats = ModelStats(last_mean_input_tps=100.0)
    a, b = join(state, "a"), join(state, "b", cluster_id="c2")
    assert state.apply_update(a, {"shared": stats, "only-a": stats}, MS)
    assert state.apply_update(b, {"shared": stats}, MS)

    def answers(target: Target, *server_errors: bool) -> None:
        for error in server_errors:
            reservation = state.reserve(target, "a", 10, 0)
            if error:
                state.server_error(reservation)
            else:
                state.answered(reservation)
            state.finish(reservation)

    answers(shared, True, True, True, True)
    answers(only_a, False)  # another model's answer: the row for "shared" goes on
    answers(shared, True)
    assert reported == [("a", "shared")]
    view = state.view(shared)
    assert view is not None and [c.cluster_id for c in view.candidates] == ["c2"]
    assert state.view(only_a) is not None and state.is_routable("a")
    assert state.apply_update(a, {"shared": stats, "only-a": stats}, MS)  # a heartbeat within the hold
    view = state.view(shared)
    assert view is not None and len(view.candidates) == 1
    clock.now += SERVER_ERROR_HOLD_S
    assert state.apply_update(a, {"shared": stats, "only-a": stats}, MS)
    view = state.view(shared)
    assert view is not None and len(view.candidates) == 2
    answers(only_a, *[True] * SERVER_ERRORS_IN_A_ROW)
    assert reported == [("a", "shared")]  # never the last backend of a model
    assert state.view(only_a) is not None
