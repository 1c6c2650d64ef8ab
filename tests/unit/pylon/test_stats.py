from __future__ import annotations

import pytest

from stargate.pylon.models import Generation
from stargate.pylon.observer import RequestObserver
from stargate.pylon.stats.counters import REQUEST_TTL_S, CounterTracker
from stargate.pylon.stats.kv import parse_kv
from stargate.pylon.stats.ndjson import PingEvent, StatsEvent
from stargate.pylon.stats.observation import Endpoint, Observation, State
from stargate.wire.limits import MAX_REMEMBERED_CHARS

from .helpers import Rig, make_rig


def stats(rig: Rig, rid: str, p: int | None, g: int | None, finished: bool = False) -> str | None:
    return rig.hub.on_engine_stats(StatsEvent(rid, rig.gen.model_id, p, g, finished))


def tracked(rig: Rig, rid: str = "req-1") -> str:
    rig.load.track(rid, rig.gen, 0, 10)
    return rid


def test_b48_output_tps_from_stream() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 0)
    rig.clock.advance(0.1)
    stats(rig, rid, 10, 1)
    rig.clock.advance(0.1)
    stats(rig, rid, 10, 5)
    snap = rig.hub.snapshot(rig.gen)
    assert snap.output_tps == pytest.approx(40) and snap.max_output_tps == pytest.approx(40)
    assert snap.stats_sources == ("engine_stats_stream",)
    assert snap.stats_capabilities == ("model.throughput.engine_stream",)


def test_b49_input_tps_needs_five_samples() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, None)
    for i in range(1, 6):
        rig.clock.advance(0.1)
        stats(rig, rid, 10 * i, None)
        expected = 100 if i == 5 else 0
        assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(expected)


def test_b50_bootstrap_moves_with_samples() -> None:
    rig = make_rig(initial_input_tps=100)
    rid = tracked(rig)
    stats(rig, rid, 0, None)
    rig.clock.advance(0.1)
    stats(rig, rid, 20, None)
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(700 / 6)


def test_b51_pinned_tps_stays() -> None:
    rig = make_rig(initial_input_tps=2200, pin=True)
    rid = tracked(rig)
    stats(rig, rid, 0, None)
    for i in range(1, 20):
        rig.clock.advance(0.1)
        stats(rig, rid, 1000 * i, None)
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == 2200


def test_a_first_events_counts_are_a_baseline_not_a_sample() -> None:
    """A non-streamed request's one ``finished`` event has no time base: the spec measured it over
    the 10 ms floor (20 tokens from an engine making 20 a second published 2 000 tokens/s)."""
    rig = make_rig(initial_input_tps=100)
    stats(rig, tracked(rig), 40, 20, finished=True)
    snap = rig.hub.snapshot(rig.gen)
    assert snap.output_tps == 0 and snap.max_output_tps == 0
    assert snap.last_mean_input_tps == pytest.approx(100)


def test_output_is_measured_from_the_first_token() -> None:
    """The first token over the time to it is no decode rate (1 token in 10 ms read as 100/s)."""
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 0)
    rig.clock.advance(0.001)
    stats(rig, rid, 10, 1)
    assert rig.hub.snapshot(rig.gen).max_output_tps == 0
    rig.clock.advance(0.1)
    stats(rig, rid, 10, 3)
    assert rig.hub.snapshot(rig.gen).max_output_tps == pytest.approx(20)


def test_b53_accumulates_below_floor() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 0)
    rig.clock.advance(0.001)
    stats(rig, rid, None, 1)
    for g in range(2, 10):
        rig.clock.advance(0.001)
        stats(rig, rid, None, g)
    assert rig.hub.snapshot(rig.gen).max_output_tps == 0
    rig.clock.advance(0.002)
    stats(rig, rid, None, 11)
    snap = rig.hub.snapshot(rig.gen)
    assert snap.max_output_tps == pytest.approx(1000) and snap.output_tps == pytest.approx(1000)


def test_b54_regressing_and_post_finalize() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 5)
    assert stats(rig, rid, 0, 3) == "regressing_counters"
    stats(rig, rid, 0, 6, finished=True)
    assert stats(rig, rid, 0, 7) == "post_finalize"


def test_long_request_ids_are_counted_and_kept_by_digest() -> None:
    """Entries live 300 s: 8 KB ids took a Pylon from 77 to 203 MB in three minutes."""
    rig = make_rig()
    rid = tracked(rig, "r" * 8000)
    stats(rig, rid, 0, 5)
    assert stats(rig, rid, 0, 3) == "regressing_counters"  # the same entry, found by the long id
    assert stats(rig, "r" * 7999 + "x", 0, 1) is None  # another id: not the same entry
    assert max(map(len, rig.hub._counters._entries)) <= MAX_REMEMBERED_CHARS


def test_b55_unknown_request_and_model_dropped() -> None:
    rig = make_rig()
    before = rig.hub.snapshot(rig.gen)
    assert rig.hub.on_engine_stats(StatsEvent("nobody", "other-model", 10, 10, False)) is None
    assert rig.hub.snapshot(rig.gen) == before


def ten_tokens_a_second(rig: Rig, rid: str) -> None:
    stats(rig, rid, 0, 0)
    rig.clock.advance(0.1)
    stats(rig, rid, 4, 1)
    rig.clock.advance(1.0)
    stats(rig, rid, 4, 11, finished=True)


def test_b56_calibration_ids_ignored_foreign_processed() -> None:
    rig = make_rig(floor_s=0.1)
    ten_tokens_a_second(rig, rig.hub.ids.new("calibration", rig.gen.seq))
    assert rig.hub.snapshot(rig.gen).output_tps == 0
    foreign = f"calibration-99999999-2222-3333-4444-555555555555-g{rig.gen.seq}-1"
    tracked(rig, foreign)
    ten_tokens_a_second(rig, foreign)
    assert rig.hub.snapshot(rig.gen).output_tps == pytest.approx(10)


def test_canary_events_do_not_feed_the_rates() -> None:
    """A 4-token canary measures the engine's fixed costs: an idle fleet's canaries took a
    published input rate from 5 000 to 1 610 tokens/s."""
    rig = make_rig(initial_input_tps=5000)
    for _ in range(5):
        ten_tokens_a_second(rig, rig.hub.ids.new("canary", rig.gen.seq))
    snap = rig.hub.snapshot(rig.gen)
    assert snap.last_mean_input_tps == 5000 and snap.max_output_tps == 0
    assert snap.stats_sources == ()


def test_b57_stale_output_cleared_input_kept() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 0)
    for i in range(1, 6):
        rig.clock.advance(0.1)
        stats(rig, rid, 10 * i, 4 * i)
    rig.clock.advance(30.5)
    rig.hub.sweep()
    snap = rig.hub.snapshot(rig.gen)
    assert snap.output_tps == 0 and snap.max_output_tps == pytest.approx(40)
    assert snap.last_mean_input_tps == pytest.approx(100)


def test_b58_live_request_swept_after_300s() -> None:
    rig = make_rig()
    rid = tracked(rig)
    stats(rig, rid, 0, 0)
    rig.clock.advance(301)
    rig.hub.sweep()
    assert request_cleanups(rig) == 1
    assert stats(rig, rid, 10, 10, finished=True) == "post_finalize"


def request_cleanups(rig: Rig) -> float:
    sample = rig.hub.metrics.registry.get_sample_value(
        "pylon_engine_stats_stale_cleanups_total", {"kind": "request"}
    )
    return sample or 0.0


def test_a_request_pylon_saw_end_is_no_longer_live() -> None:
    """An engine sends no ``finished`` for a request whose client hung up: it counted as live for
    300 s, then as a stale cleanup, as if the engine stream had lost its events."""
    rig = make_rig(floor_s=0.1)
    rid = tracked(rig)
    rig.hub.on_request_tracked(rid, rig.gen)
    stats(rig, rid, 0, 1)
    assert rig.hub.counter_entries() == 1
    rig.load.release(rid)
    rig.hub.on_observation(obs(rig, State.CANCELLED, request_id=rid))
    assert rig.hub.counter_entries() == 0
    rig.clock.advance(0.5)
    assert stats(rig, rid, 10, 6) is None  # a late event still counts, and leaves it ended
    assert rig.hub.snapshot(rig.gen).output_tps == pytest.approx(10)
    assert rig.hub.counter_entries() == 0
    rig.clock.advance(301)
    rig.hub.sweep()
    assert request_cleanups(rig) == 0
    assert stats(rig, rid, 20, 9) is None and rig.hub.counter_entries() == 0  # gone: unknown, dropped


def test_an_id_used_again_after_its_request_ended_is_live_again() -> None:
    """Live in the gauge again. The engine may still run the earlier request: its next cumulative
    count continues its counters (read from zero it was 15 tokens in no time: 1500 tokens/s)."""
    rig = make_rig(floor_s=0.01)
    rid = tracked(rig)
    rig.hub.on_request_tracked(rid, rig.gen)
    stats(rig, rid, 0, 0)
    rig.clock.advance(0.5)
    stats(rig, rid, 0, 5)
    rig.hub.on_observation(obs(rig, State.CANCELLED, request_id=rid))
    rig.hub.on_request_tracked(rid, rig.gen)
    assert rig.hub.counter_entries() == 1
    rig.clock.advance(1.0)
    assert stats(rig, rid, 0, 15) is None
    assert rig.hub.snapshot(rig.gen).max_output_tps == pytest.approx(10)
    # An id whose earlier request got no counters from the engine starts over with its own.
    other = tracked(rig, "req-2")
    rig.hub.on_request_tracked(other, rig.gen)
    rig.hub.on_observation(obs(rig, State.CANCELLED, request_id=other))
    rig.hub.on_request_tracked(other, rig.gen)
    assert stats(rig, other, 0, 0) is None and rig.hub.counter_entries() == 2


def test_chunk_usage_entries_end_with_their_request() -> None:
    rig = make_rig(fallback=True)
    rig.hub.on_request_tracked("r", rig.gen)
    rig.hub.on_usage("r", rig.gen, 3)
    assert rig.hub.counter_entries() == 1
    rig.hub.on_observation(obs(rig, State.COMPLETE, output_tokens=3, output_tokens_from_chunk_usage=True))
    assert rig.hub.counter_entries() == 0
    rig.clock.advance(301)
    rig.hub.sweep()
    assert request_cleanups(rig) == 0


def obs(rig: Rig, state: State, **kw: object) -> Observation:
    defaults: dict[str, object] = dict(
        request_id="r", generation=rig.gen, endpoint=Endpoint.CHAT, state=state, input_tokens=50
    )
    defaults.update(kw)
    return Observation(**defaults)  # type: ignore[arg-type]


def test_b59_fallback_input_samples_from_complete_chats() -> None:
    rig = make_rig(fallback=True)
    for i in range(5):
        rig.hub.on_observation(
            obs(rig, State.COMPLETE, request_id=f"r{i}", time_to_first_output=0.5, elapsed=1)
        )
        expected = 100 if i == 4 else 0
        assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(expected)


def test_fallback_input_samples_time_each_prefill_on_a_serial_engine() -> None:
    """Three prompts sent at once to an engine prefilling 1 000 tokens in 0.1 s, one after
    another: each sample is 10 000 tokens/s (their times to first output give 10 000, 5 000 and
    3 333). A prompt sent to an idle engine is timed from its sending."""
    rig = make_rig(fallback=True, initial_input_tps=10_000)

    def sent(rid: str) -> RequestObserver:
        observer = RequestObserver(
            request_id=rid,
            generation=rig.gen,
            endpoint=Endpoint.CHAT,
            input_tokens=1000,
            clock=rig.clock,
            sink=rig.hub.on_observation,
        )
        observer.headers(200)
        return observer

    observers = [sent(f"r{i}") for i in range(3)]
    for observer in observers:
        rig.clock.advance(0.1)
        observer.output(1)
    rig.clock.advance(0.5)
    for observer in observers:
        observer.output(20)
        assert observer.finish() is State.COMPLETE
        assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(10_000)
    rig.clock.advance(5)
    late = sent("late")
    rig.clock.advance(0.1)
    late.output(1)
    late.finish()
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(10_000)


def test_b60_fallback_output_tps() -> None:
    rig = make_rig(fallback=True)
    rig.hub.on_observation(
        obs(rig, State.COMPLETE, output_tokens=30, time_to_first_output=3, time_to_first_token=3, elapsed=9)
    )
    assert rig.hub.snapshot(rig.gen).output_tps == pytest.approx(5.0)


def test_b61_decode_falls_back_to_ttfo() -> None:
    rig = make_rig(fallback=True)
    rig.hub.on_observation(
        obs(
            rig, State.COMPLETE, output_tokens=8, time_to_first_output=2, time_to_first_token=5.995, elapsed=6
        )
    )
    assert rig.hub.snapshot(rig.gen).output_tps == pytest.approx(2.0)


def test_b62_non_terminal_no_input_sample() -> None:
    rig = make_rig(fallback=True)
    for i in range(6):
        rig.hub.on_observation(obs(rig, State.INPUT_PROCESSING, request_id=f"r{i}", time_to_first_output=0.5))
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == 0


def test_b63_live_output_rate() -> None:
    rig = make_rig(fallback=True)
    rig.hub.on_observation(
        obs(
            rig,
            State.OUTPUT_GENERATION,
            output_tokens=8,
            time_to_first_output=2,
            time_to_first_token=2,
            elapsed=3,
        )
    )
    assert rig.hub.snapshot(rig.gen).output_tps == pytest.approx(8.0)


def test_b64_chunk_usage_labels() -> None:
    rig = make_rig(fallback=True)
    rig.hub.on_observation(
        obs(rig, State.OUTPUT_GENERATION, output_tokens=3, output_tokens_from_chunk_usage=True)
    )
    snap = rig.hub.snapshot(rig.gen)
    assert snap.stats_capabilities == ("request.output.chunk_usage",)
    assert snap.stats_sources == ("chunk_usage",)


def test_b65_kv_stats() -> None:
    rig = make_rig(model="model-a")
    body = (
        b'{"model":"model-a","kv_cache_capacity_tokens":1000,"kv_cache_used_tokens":250,'
        b'"kv_cache_free_tokens":750,"entries":3}'
    )
    parsed = parse_kv(body)
    assert parsed == ("model-a", 1000, 250, 750)
    assert rig.hub.on_kv(*parsed)
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens, snap.kv_cache_free_tokens) == (
        1000,
        250,
        750,
    )
    assert snap.stats_sources == ("kv_cache_stats",)
    assert not rig.hub.on_kv("unconfigured", 1, 1, 0)
    assert parse_kv(b'{"model":"m","kv_cache_capacity_tokens":-1}') is None


def test_b78_fallback_limit_published() -> None:
    assert make_rig(limit=25).hub.snapshot(make_rig(limit=25).gen).max_engine_concurrency == 25


def test_b79_engine_limit_override_withdraw_keep() -> None:
    rig = make_rig(limit=25)
    rig.hub.on_ping(PingEvent("llama", 40))
    assert rig.hub.snapshot(rig.gen).max_engine_concurrency == 40
    rig.hub.on_ping(PingEvent("llama", 0))
    assert rig.hub.snapshot(rig.gen).max_engine_concurrency == 25
    rig.hub.on_ping(PingEvent("llama", 30))
    rig.hub.on_ping(PingEvent("llama", None))
    rig.hub.on_ping(PingEvent(None, None))
    assert rig.hub.snapshot(rig.gen).max_engine_concurrency == 30


def test_an_engine_limit_reported_before_a_generation_applies_to_it() -> None:
    """The ping sent when the stream connects comes before Pylon's first generation; dropping it
    published no limit (unlimited, to a router) until the next ping."""
    rig = make_rig(limit=25)
    rig.hub.on_ping(PingEvent("llama", 40))
    rig.hub.on_ping(PingEvent("other", 7))
    rig.registry.retire("llama")
    new = rig.registry.allocate("llama")
    rig.hub.init_generation(new)
    assert rig.hub.snapshot(new).max_engine_concurrency == 40
    rig.hub.on_ping(PingEvent("llama", 0))  # withdrawn: the next generation starts from the fallback
    rig.registry.retire("llama")
    newer = rig.registry.allocate("llama")
    rig.hub.init_generation(newer)
    assert rig.hub.snapshot(newer).max_engine_concurrency == 25


def test_a_new_effective_limit_is_published_promptly() -> None:
    rig = make_rig(limit=25)
    changes: list[int] = []
    rig.hub.on_change = lambda: changes.append(rig.hub.effective_limit(rig.gen))
    rig.hub.on_ping(PingEvent("llama", 40))
    rig.hub.on_ping(PingEvent("llama", 40))  # the same limit again: nothing new to publish
    rig.hub.on_ping(PingEvent("llama", 0))
    assert changes == [40, 25]


def test_concurrency_update_for_stale_generation_is_discarded() -> None:
    from stargate.pylon.stats.hub import ConcurrencyUpdate, LimitSource

    rig = make_rig(limit=25)
    old = rig.gen
    rig.registry.retire("llama")
    new = rig.registry.allocate("llama")
    rig.hub.init_generation(new)
    assert not rig.hub.apply_concurrency(ConcurrencyUpdate(old, LimitSource.ENGINE, 99))
    assert rig.hub.snapshot(new).max_engine_concurrency == 25
    assert new != Generation("llama", old.seq)


def test_b107_embedding_item_tps_pylon_only() -> None:
    """§6.4: items / max(total - headers, 10 ms), window 8, max kept; never in ModelStats."""
    r = make_rig()

    def done(rid: str, items: int | None, ttrh: float, elapsed: float) -> None:
        r.hub.on_observation(
            Observation(rid, r.gen, Endpoint.EMBEDDINGS, State.COMPLETE, input_tokens=10,
                        time_to_response_headers=ttrh, elapsed=elapsed, upstream_status=200,
                        embedding_items=items)
        )  # fmt: skip

    done("e1", 3, 0.5, 1.5)  # 3 items over 1 s
    assert r.hub.embedding_item_tps(r.gen) == (3.0, 3.0)
    done("e2", 2, 0.2, 0.2)  # no time after headers: the 10 ms floor
    assert r.hub.embedding_item_tps(r.gen) == (101.5, 200.0)
    done("e3", 0, 0.1, 0.5)  # no items, no sample
    done("e4", None, 0.1, 0.5)  # unknown count, no sample
    assert r.hub.embedding_item_tps(r.gen) == (101.5, 200.0)
    for i in range(8):
        done(f"w{i}", 1, 0.0, 1.0)
    assert r.hub.embedding_item_tps(r.gen) == (1.0, 200.0)
    stats = r.hub.snapshot(r.gen)
    assert stats.output_tps == 0 and stats.max_output_tps == 0


def test_embeddings_feed_the_input_rate_over_their_time_to_response_headers() -> None:
    """An embeddings answer's head comes when its prompt is processed: its time is the prefill's,
    floored at 10 ms (a faster head is the floor's rate, not an implausible one)."""
    rig = make_rig(fallback=True)
    for i in range(5):
        rig.hub.on_observation(
            obs(rig, State.COMPLETE, request_id=f"e{i}", endpoint=Endpoint.EMBEDDINGS,
                time_to_response_headers=0.5, elapsed=0.6)
        )  # fmt: skip
    assert rig.hub.snapshot(rig.gen).last_mean_input_tps == pytest.approx(100)  # 50 tokens in 0.5 s
    floored = make_rig(fallback=True)
    for i in range(5):
        floored.hub.on_observation(
            obs(floored, State.COMPLETE, request_id=f"e{i}", endpoint=Endpoint.EMBEDDINGS,
                time_to_response_headers=0.002, elapsed=0.003)
        )  # fmt: skip
    assert floored.hub.snapshot(floored.gen).last_mean_input_tps == pytest.approx(5000)  # over 10 ms


def test_a_sweep_finds_every_entry_due_behind_one_seen_since() -> None:
    """The sweep reads the store oldest-seen first and stops at the first entry not due, so an
    entry seen again must move behind those it was created before."""
    counters = CounterTracker(0.01)
    gen = Generation("m", 1)
    long_id = "0" * (MAX_REMEMBERED_CHARS + 1)  # kept by its digest
    for rid in ("a", "b", "c", long_id):
        counters.observe(rid, gen, 0.0)
    counters.end("a", gen, 100.0)  # Pylon saw a end at 100 s: kept for the engine's late events
    counters.end(long_id, gen, 100.0)
    counters.sweep(REQUEST_TTL_S + 1.0)
    assert [counters.owner(rid) for rid in ("a", "b", "c", long_id)] == [gen, None, None, gen]
    counters.sweep(REQUEST_TTL_S + 101.0)
    assert counters.owner("a") is None and counters.owner(long_id) is None
