"""``--engine-prefix-caching``: a request's prompt work is what the engine's prefix cache does not
cover, known from the last prompt of its cache-affinity key that Pylon sent to the engine."""

from __future__ import annotations

import pytest

from stargate.pylon import load as load_module
from stargate.pylon.load import LiveLoad, Phase
from stargate.pylon.models import Generation, ModelRegistry
from stargate.wire.proto import MAX_AFFINITY_KEY_CHARS


def generation(model: str = "llama") -> Generation:
    return ModelRegistry().allocate(model)


def prefilled(load: LiveLoad, request_id: str, gen: Generation, tokens: int, key: str | None) -> None:
    """A request of ``key`` sent to the engine, answered and ended."""
    load.track(request_id, gen, 0, tokens, key)
    load.sent(request_id)
    load.advance(request_id, Phase.OUTPUT_GENERATION)
    load.release(request_id)


def test_off_counts_every_input_token_as_the_spec_says() -> None:
    gen = generation()
    load = LiveLoad()
    prefilled(load, "r1", gen, 1000, "conv")
    load.track("r2", gen, 0, 1200, "conv")
    snap = load.snapshot(gen)
    assert (snap.queued_input_size, snap.total_query_input_size) == (1200, 1200)
    assert load.estimates(gen, 100.0) == {0: 12_000}


def test_a_longer_prompt_of_a_prefilled_key_counts_only_its_growth() -> None:
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    prefilled(load, "r1", gen, 1000, "conv")
    load.track("r2", gen, 2, 1200, "conv")
    load.track("r3", gen, 2, 500, None)
    snap = load.snapshot(gen)
    # Work is the growth (200) plus the keyless prompt; the input total stays every token.
    assert (snap.queue_size, snap.queued_input_size, snap.total_query_input_size) == (2, 700, 1700)
    assert load.estimates(gen, 100.0) == {2: 7000}
    # Admission leaves out the request's own work: its growth, not its whole prompt.
    assert load.estimates(gen, 100.0, exclude_request_id="r2") == {2: 5000}
    load.advance("r2", Phase.INPUT_PROCESSING)
    assert load.estimates(gen, 100.0) == {0: 2000, 2: 7000}
    load.sent("r2")
    load.advance("r2", Phase.OUTPUT_GENERATION)
    load.release("r2")
    # r2's prompt is the cached prefix now: the next turn counts what it adds to 1200.
    load.track("r4", gen, 0, 1250, "conv")
    assert load.snapshot(gen).queued_input_size == 500 + 50


def test_a_turn_queued_behind_its_predecessor_counts_only_its_growth() -> None:
    # The engine schedules it after the earlier prompt, whose prefix is cached by then.
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    load.track("r1", gen, 0, 1000, "conv")
    assert load.snapshot(gen).queued_input_size == 1000
    load.sent("r1")
    load.track("r2", gen, 0, 1100, "conv")
    assert load.snapshot(gen).queued_input_size == 1000 + 100


def test_a_request_never_sent_to_the_engine_leaves_no_prefix() -> None:
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    load.track("rejected", gen, 0, 1000, "conv")  # admission said no: it never reached the engine
    load.release("rejected")
    load.track("r2", gen, 0, 1100, "conv")
    assert load.snapshot(gen).queued_input_size == 1100


def test_a_shorter_prompt_another_key_or_another_model_counts_in_full() -> None:
    gen, other = generation("llama"), generation("mistral")
    load = LiveLoad(prefix_caching=True)
    prefilled(load, "r1", gen, 1000, "conv")
    load.track("shorter", gen, 0, 900, "conv")
    load.track("another-key", gen, 0, 1200, "other")
    load.track("another-model", other, 0, 1200, "conv")
    assert load.snapshot(gen).queued_input_size == 900 + 1200
    assert load.snapshot(other).queued_input_size == 1200


def test_the_same_prompt_again_is_no_prompt_work() -> None:
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    prefilled(load, "r1", gen, 1000, "conv")
    load.track("r2", gen, 0, 1000, "conv")
    snap = load.snapshot(gen)
    assert (snap.queue_size, snap.queued_input_size) == (1, 0)
    assert load.estimates(gen, 100.0) == {}


def test_a_purged_generation_forgets_its_prompts() -> None:
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    prefilled(load, "r1", gen, 1000, "conv")
    load.purge_generation(gen)
    load.track("r2", gen, 0, 1200, "conv")
    assert load.snapshot(gen).queued_input_size == 1200


def test_the_prompt_memory_is_bounded_least_recently_used_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_module, "PROMPT_MEMORY", 2)
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    prefilled(load, "a1", gen, 100, "a")
    prefilled(load, "b1", gen, 100, "b")
    prefilled(load, "a2", gen, 100, "a")  # "a" used again: "b" is now the least recently used
    prefilled(load, "c1", gen, 100, "c")
    load.track("a3", gen, 0, 150, "a")
    load.track("b2", gen, 0, 150, "b")
    load.track("c2", gen, 0, 150, "c")
    assert load.snapshot(gen).queued_input_size == 50 + 150 + 50


def test_keys_too_long_to_publish_are_not_remembered() -> None:
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    long_key = "k" * (MAX_AFFINITY_KEY_CHARS + 1)
    prefilled(load, "r1", gen, 1000, long_key)
    load.track("r2", gen, 0, 1200, long_key)
    assert load.snapshot(gen).queued_input_size == 1200


def test_a_long_key_is_remembered_by_its_digest() -> None:
    """65 536 keys of 1 000 characters kept as sent took a Pylon up by 106 MB."""
    gen = generation()
    load = LiveLoad(prefix_caching=True)
    key = "k" * MAX_AFFINITY_KEY_CHARS
    prefilled(load, "r1", gen, 1000, key)
    load.track("r2", gen, 0, 1200, key)
    assert load.snapshot(gen).queued_input_size == 200  # still found
    assert all(len(remembered_key) < 100 for _, remembered_key in load._prompts)
