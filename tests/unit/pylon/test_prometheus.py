from __future__ import annotations

import asyncio
import gzip
import logging
from collections.abc import Callable

import pytest
from aiohttp import web

from stargate.mock_engine.engine import Engine, EngineConfig
from stargate.mock_engine.metrics import render
from stargate.pylon.admission import AdmissionConfig, Result, decide
from stargate.pylon.load import U64_MAX, Phase
from stargate.pylon.registration import stats_to_proto
from stargate.pylon.stats.hub import StatsHub
from stargate.pylon.stats.prometheus import (
    apply_engine_metrics,
    forget_engine_report,
    parse_engine_metrics,
    run_prometheus_poller,
)
from stargate.wire.http_client import client_session

from .helpers import make_rig

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="llama"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100",model_name="llama"} 1.0
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama"} 1.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama"} 4.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="llama"} 0.5
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="llama"} 2000.0
"""


def test_vllm_metrics_published() -> None:
    rig = make_rig()
    assert apply_engine_metrics(rig.hub, parse_engine_metrics(VLLM)) == 1
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.num_running_queries) == (2, 5)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens, snap.kv_cache_free_tokens) == (
        1600,
        400,
        1200,
    )
    assert snap.stats_sources == ("engine_prometheus",)


def test_sglang_metrics_published() -> None:
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(SGLANG))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.queue_size, snap.num_running_queries) == (4, 5)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens) == (2000, 1000)


def test_own_tracking_wins_when_larger() -> None:
    rig = make_rig()
    for i in range(7):
        rig.load.track(f"r{i}", rig.gen, 0, 1)
    apply_engine_metrics(rig.hub, parse_engine_metrics(SGLANG))
    assert rig.hub.snapshot(rig.gen).queue_size == 7


def test_mock_engine_metrics_counted_once() -> None:
    """The mock exports vLLM's and SGLang's names for one engine: 8 running is 8, not 16."""
    engine = Engine(EngineConfig(model="llama", max_concurrent_requests=8, kv_cache_capacity_tokens=1000))
    engine.slots.running = 8
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(render(engine)))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size) == (8, 0)
    assert snap.kv_cache_capacity_tokens == 1000


def test_aliases_take_the_largest_never_the_sum() -> None:
    both = VLLM + SGLANG  # running 3 vs 1, waiting 2 vs 4
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(both))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size) == (3 + 4, 4)


def test_series_of_one_name_are_summed_across_ranks() -> None:
    ranks = """vllm:num_requests_running{model_name="llama",engine="0"} 2
vllm:num_requests_running{model_name="llama",engine="1"} 3
vllm:kv_cache_usage_perc{model_name="llama",engine="0"} 0.2
vllm:kv_cache_usage_perc{model_name="llama",engine="1"} 0.4
vllm:cache_config_info{block_size="10",num_gpu_blocks="100",model_name="llama",engine="0"} 1
vllm:cache_config_info{block_size="10",num_gpu_blocks="100",model_name="llama",engine="1"} 1
"""
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(ranks))
    snap = rig.hub.snapshot(rig.gen)
    assert snap.num_running_queries == 5
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens) == (2000, 600)


def test_tensor_parallel_ranks_count_once_and_a_repeated_series_once() -> None:
    """SGLang's TP ranks (``--enable-metrics-for-all-schedulers``) report one shared batch; a page
    repeating a series is no second engine."""
    page = """sglang:num_running_reqs{model_name="llama",tp_rank="0",dp_rank="0"} 5
sglang:num_running_reqs{model_name="llama",tp_rank="1",dp_rank="0"} 5
sglang:num_running_reqs{model_name="llama",tp_rank="0",dp_rank="1"} 3
sglang:num_running_reqs{model_name="llama",tp_rank="1",dp_rank="1"} 3
sglang:max_total_num_tokens{model_name="llama",tp_rank="0",dp_rank="0"} 1000
sglang:max_total_num_tokens{model_name="llama",tp_rank="1",dp_rank="0"} 1000
sglang:num_used_tokens{model_name="llama",tp_rank="0",dp_rank="0"} 100
sglang:num_used_tokens{model_name="llama",tp_rank="1",dp_rank="0"} 100
vllm:num_requests_waiting{model_name="llama",engine="0"} 2
vllm:num_requests_waiting{model_name="llama",engine="0"} 2
"""
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(page))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size) == (5 + 3 + 2, 2)
    assert (snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens) == (1000, 100)


def test_sglang_used_tokens_and_old_name_label() -> None:
    old = """sglang:num_running_reqs{name="llama"} 2
sglang:num_used_tokens{name="llama"} 700
sglang:max_total_num_tokens{name="llama"} 1000
sglang:token_usage{name="llama"} 0.1
"""
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(old))
    snap = rig.hub.snapshot(rig.gen)
    assert snap.num_running_queries == 2
    assert (snap.kv_cache_used_tokens, snap.kv_cache_free_tokens) == (700, 300)


def test_unlabelled_series_fill_what_the_model_lacks() -> None:
    mixed = 'vllm:num_requests_running{model_name="llama"} 2\nvllm:num_requests_waiting 5\n'
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(mixed))
    assert rig.hub.snapshot(rig.gen).num_running_queries == 7


STOCK_VLLM = """vllm:num_requests_running{model_name="llama",engine="0"} 30.0
vllm:num_requests_waiting{model_name="llama",engine="0"} 10.0
vllm:kv_cache_usage_perc{model_name="llama",engine="0"} 0.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
"""


@pytest.mark.parametrize(
    "page",
    [
        STOCK_VLLM.replace('"llama"', '"llama-v2"'),
        STOCK_VLLM.replace("30.0", "NaN").replace("10.0", "NaN"),
        STOCK_VLLM.replace("30.0", "+Inf").replace("10.0", "+Inf"),
        'vllm:kv_cache_usage_perc{model_name="llama"} 0.5\nvllm:num_requests_running{engine="0"} NaN\n',
    ],
    ids=["renamed", "nan", "inf", "kv_only"],
)
def test_a_model_without_load_series_of_its_own_loses_the_engine_report(page: str) -> None:
    """vLLM's cache_config_info has no model_name: it is no load report, so the last one (40
    requests, of an engine since renamed or reporting NaN) is not kept for an idle engine."""
    rig = make_rig()
    assert apply_engine_metrics(rig.hub, parse_engine_metrics(STOCK_VLLM)) == 1
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size, snap.kv_cache_capacity_tokens) == (40, 10, 1600)
    assert apply_engine_metrics(rig.hub, parse_engine_metrics(page)) == 0
    assert rig.hub.snapshot(rig.gen).num_running_queries == 0


def test_absurd_engine_values_are_bounded() -> None:
    absurd = """vllm:num_requests_running{model_name="llama"} 1e30
vllm:num_requests_waiting{model_name="llama"} -4
vllm:kv_cache_usage_perc{model_name="llama"} NaN
sglang:max_total_num_tokens{model_name="llama"} +Inf
vllm:cache_config_info{block_size="1%s",num_gpu_blocks="1",model_name="llama"} 1
""" % ("0" * 5000)
    rig = make_rig()
    apply_engine_metrics(rig.hub, parse_engine_metrics(absurd))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size) == (U64_MAX, 0)
    stats_to_proto(snap)  # every field fits its protobuf type


def test_every_published_load_field_is_at_least_pylons_own_count() -> None:
    """The engine's report lags (0 running) while Pylon relays 3: Pylon's counts are published."""
    rig = make_rig()
    rig.load.track("a", rig.gen, 0, 100)
    rig.load.track("b", rig.gen, 0, 50)
    rig.load.advance("b", Phase.INPUT_PROCESSING)
    rig.load.track("c", rig.gen, 0, 10)
    rig.load.advance("c", Phase.OUTPUT_GENERATION)
    idle = 'vllm:num_requests_running{model_name="llama"} 0\nsglang:num_queue_reqs{model_name="llama"} 0\n'
    apply_engine_metrics(rig.hub, parse_engine_metrics(idle))
    snap = rig.hub.snapshot(rig.gen)
    assert (snap.num_running_queries, snap.queue_size, snap.queued_input_size) == (3, 2, 150)
    assert (snap.input_processing_queries, snap.output_generation_queries) == (1, 1)
    assert snap.total_query_input_size == 160


def test_requests_that_ended_since_the_poll_are_not_counted_from_the_engines_report() -> None:
    """The page is up to a poll old: Pylon's own requests are counted as they stand, and only what
    the engine held beyond them at the poll (another client's) is added. A 2 x 8 fleet looked full
    with 14 requests in flight, and wait-and-widen answered 503 with slots free."""
    rig = make_rig()
    for i in range(8):
        rig.load.track(f"r{i}", rig.gen, 0, 10)
        rig.load.advance(f"r{i}", Phase.OUTPUT_GENERATION)
    page = 'vllm:num_requests_running{model_name="llama"} 10\n'
    apply_engine_metrics(rig.hub, parse_engine_metrics(page))  # 8 of Pylon's, 2 of another client
    assert rig.hub.snapshot(rig.gen).num_running_queries == 10
    for i in range(6):
        rig.load.release(f"r{i}")
    assert rig.hub.snapshot(rig.gen).num_running_queries == 2 + 2
    rig.load.track("new", rig.gen, 0, 10)
    assert rig.hub.snapshot(rig.gen).num_running_queries == 3 + 2


def test_a_running_canary_on_the_engines_page_is_not_another_clients_request() -> None:
    """Pylon's own canary is on the engine's page but not in the published load: counted as load
    from elsewhere, an idle fleet showed one of its slots taken every 5 s (all the time with long
    canaries), and the quickstart fleet answered 503 at 14 requests in flight."""
    rig = make_rig()
    page = 'vllm:num_requests_running{model_name="llama"} 1\n'
    with rig.load.occupying(rig.gen):
        apply_engine_metrics(rig.hub, parse_engine_metrics(page))
        assert rig.hub.snapshot(rig.gen).num_running_queries == 0


def test_engine_load_above_own_count_never_makes_pylon_reject() -> None:
    """Admission counts Pylon's own requests (minus the incoming one): a busier engine report only
    makes Stargate's view more conservative, so a free slot here still accepts expected 0."""
    rig = make_rig(initial_input_tps=100, limit=4)
    for i in range(2):
        rig.load.track(f"other{i}", rig.gen, 0, 100_000)
    rig.load.track("new", rig.gen, 0, 10)
    apply_engine_metrics(rig.hub, parse_engine_metrics(VLLM))  # 3 running + 2 waiting
    assert rig.hub.snapshot(rig.gen).num_running_queries == 5
    d = decide(
        AdmissionConfig(),
        "0",
        load=rig.load,
        gen=rig.gen,
        request_id="new",
        priority=0,
        input_tps=rig.hub.input_tps(rig.gen),
        limit=rig.hub.effective_limit(rig.gen),
    )
    assert (d.result, d.actual_ms) == (Result.ACCEPTED, 0)


class _Done(Exception):
    pass


async def poll_pages(
    hub: StatsHub,
    pages: list[tuple[int, str]],
    check: Callable[[int], None],
    *,
    gzip_when_asked: bool = False,
    answer_after_s: float = 0.0,
) -> str:
    """Run the poller over ``pages`` with Pylon's own session; ``check(i)`` after the i-th poll;
    the page's URL."""
    served = iter(pages)

    async def page(request: web.Request) -> web.Response:
        status, text = next(served)
        await asyncio.sleep(answer_after_s)  # a busy engine rendering its page
        if gzip_when_asked and "gzip" in request.headers.get("Accept-Encoding", ""):
            # what prometheus_client's ASGI/WSGI app (vLLM's and SGLang's /metrics) does
            return web.Response(status=status, body=gzip.compress(text.encode()),
                                headers={"Content-Encoding": "gzip"})  # fmt: skip
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_get("/metrics", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"
    polls = iter(range(len(pages)))

    async def sleep(_s: float) -> None:
        n = next(polls)
        check(n)
        if n == len(pages) - 1:
            raise _Done

    try:
        async with client_session(connect_timeout_s=5.0) as session:
            with pytest.raises(_Done):
                await run_prometheus_poller(session, url, hub, interval_s=0.5, sleep=sleep)
    finally:
        await runner.cleanup()
    return url


async def test_an_engine_metrics_page_that_fails_is_logged_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pages = [(404, ""), (404, ""), (200, "other_metric 1\n"), (200, VLLM), (200, VLLM), (500, "")]
    caplog.set_level(logging.DEBUG, logger="stargate.pylon.prometheus")
    url = await poll_pages(make_rig().hub, pages, lambda _n: None)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "stargate.pylon.prometheus"]
    peer = f"engine at {url}"
    assert lines == [
        ("WARNING", f"engine metrics polling with {peer} failed (HTTP 404); retrying, first in 0.5 s"),
        ("DEBUG", f"engine metrics polling with {peer} still failing (HTTP 404)"),
        ("WARNING", f"engine metrics polling with {peer} still failing, now: "
                    "the page has none of vLLM's or SGLang's load series"),
        ("INFO", f"engine metrics polling with {peer} established"),
        ("WARNING", f"engine metrics polling with {peer} lost (HTTP 500); reconnecting"),
    ]  # fmt: skip


async def test_a_page_slower_than_the_interval_is_still_read() -> None:
    """The poll's timeout was the interval (at least 1 s): a busy engine's page taking 1.2 s was
    never read, and its load never published."""
    rig = make_rig()
    seen: list[int] = []
    await poll_pages(
        rig.hub,
        [(200, VLLM)],
        lambda _n: seen.append(rig.hub.snapshot(rig.gen).num_running_queries),
        answer_after_s=1.2,
    )
    assert seen == [5]


async def test_failed_polls_are_counted_by_reason() -> None:
    """A failing page was one log line and no metric; the stream source has its own gauges."""
    rig = make_rig()
    registry = rig.hub.metrics.registry

    def failures(reason: str) -> float | None:
        return registry.get_sample_value("pylon_engine_metrics_poll_failures_total", {"reason": reason})

    other = VLLM.replace('"llama"', '"other"')
    pages = [(200, VLLM), (500, ""), (503, ""), (200, "other_metric 1\n"), (200, other), (200, VLLM)]
    await poll_pages(rig.hub, pages, lambda _n: None)
    assert (failures("http_status"), failures("no_load_series"), failures("timeout")) == (2, 2, 0)
    async with client_session(connect_timeout_s=5.0) as session:
        with pytest.raises(_Done):
            await run_prometheus_poller(session, "http://127.0.0.1:1/metrics", rig.hub, interval_s=0.5,
                                        sleep=_stop)  # fmt: skip
    assert failures("connection") == 1


async def _stop(_s: float) -> None:
    raise _Done


async def test_polling_waits_for_the_first_model(caplog: pytest.LogCaptureFixture) -> None:
    """Pylon waits for the engine's health before it registers a model: a page polled before that
    was logged as one for a model Pylon does not serve, the model it was about to serve."""
    rig = make_rig()
    rig.registry.retire("llama")
    rig.hub.retire_generation(rig.gen)
    seen: list[int] = []

    def register(n: int) -> None:
        if n == 0:
            rig.gen = rig.registry.allocate("llama")
            rig.hub.init_generation(rig.gen)
        else:
            seen.append(rig.hub.snapshot(rig.gen).num_running_queries)

    caplog.set_level(logging.WARNING, logger="stargate.pylon.prometheus")
    await poll_pages(rig.hub, [(200, VLLM), (200, VLLM)], register)
    assert seen == [5]
    assert caplog.text == ""


async def test_a_stock_engine_page_is_asked_for_uncompressed() -> None:
    """prometheus_client gzips for a client that offers it; Pylon does not decompress."""
    rig = make_rig()
    seen: list[int] = []

    def running(_n: int) -> None:
        seen.append(rig.hub.snapshot(rig.gen).num_running_queries)

    await poll_pages(rig.hub, [(200, VLLM)], running, gzip_when_asked=True)
    assert seen == [5]


async def test_a_stale_engine_report_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A report of 5 requests left from before the page broke kept an idle engine looking busy."""
    rig = make_rig()
    other = VLLM.replace('"llama"', '"meta-llama/Llama-3.1-8B"')
    pages = [(200, VLLM), (500, ""), (500, ""), (500, ""), (200, VLLM), (200, other)]
    seen: list[int] = []
    caplog.set_level(logging.WARNING, logger="stargate.pylon.prometheus")
    await poll_pages(rig.hub, pages, lambda _n: seen.append(rig.hub.snapshot(rig.gen).num_running_queries))
    assert seen == [5, 5, 5, 0, 5, 0]  # after three failed polls; at once without the model's series
    assert "are for model_name meta-llama/Llama-3.1-8B, not a model Pylon serves" in caplog.text


async def test_a_page_without_the_models_load_names_what_it_has(caplog: pytest.LogCaptureFixture) -> None:
    rig = make_rig()
    renamed = STOCK_VLLM.replace('"llama"', '"llama-v2"')
    nan = STOCK_VLLM.replace("30.0", "NaN").replace("10.0", "NaN")
    seen: list[int] = []
    caplog.set_level(logging.WARNING, logger="stargate.pylon.prometheus")
    pages = [(200, STOCK_VLLM), (200, renamed), (200, STOCK_VLLM), (200, nan)]
    await poll_pages(rig.hub, pages, lambda _n: seen.append(rig.hub.snapshot(rig.gen).num_running_queries))
    assert seen == [40, 0, 40, 0]
    assert "lost (the page's series are for model_name llama-v2, not a model Pylon serves)" in caplog.text
    assert "lost (the page has no finite running or waiting count for model_name llama)" in caplog.text


async def test_the_pages_kv_numbers_go_with_the_engine_load() -> None:
    """An engine whose page broke while its cache was full looked full, and got no request, for good."""
    rig = make_rig()
    no_kv = "".join(line + "\n" for line in STOCK_VLLM.splitlines() if "kv_cache" not in line)
    pages = [(200, STOCK_VLLM), (500, ""), (500, ""), (500, ""), (200, STOCK_VLLM), (200, no_kv)]
    seen: list[tuple[int, int]] = []

    def kv(_n: int) -> None:
        snap = rig.hub.snapshot(rig.gen)
        seen.append((snap.kv_cache_capacity_tokens, snap.kv_cache_used_tokens))

    await poll_pages(rig.hub, pages, kv)
    assert seen == [(1600, 800), (1600, 800), (1600, 800), (0, 0), (1600, 800), (0, 0)]


def test_kv_numbers_of_the_kv_endpoint_are_not_the_pages_to_drop() -> None:
    rig = make_rig()
    rig.hub.on_kv("llama", 1000, 900, 100)
    apply_engine_metrics(rig.hub, parse_engine_metrics('vllm:num_requests_running{model_name="llama"} 1\n'))
    forget_engine_report(rig.hub)
    assert rig.hub.snapshot(rig.gen).kv_cache_used_tokens == 900


def test_only_the_lines_read_are_parsed_and_a_bad_one_is_skipped() -> None:
    """One absurd line (an integer of 400 digits, a broken label set) ended the poller and Pylon."""
    page = "\n".join(
        [
            "# HELP vllm:num_requests_running running",
            'vllm:num_requests_running{model_name="llama"} 1' + "0" * 400,
            'vllm:num_requests_running{model_name="llama"} 2',
            "vllm:num_requests_waiting{, =ng} 3",
            'vllm:num_requests_waiting{model_name="llama"} 4 1' + "0" * 400,
            'vllm:num_requests_waiting{model_name="llama"} 1',
            "other_series_with_a_bad_timestamp 1 " + "9" * 400,
            *(f'vllm:request_latency_bucket{{le="{i}"}} {i}' for i in range(1000)),
        ]
    )
    parsed = parse_engine_metrics(page)
    assert (parsed["llama"].running, parsed["llama"].waiting) == (2, 1)
