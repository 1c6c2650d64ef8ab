"""``GET /metrics`` in vLLM's and SGLang's names, so the mock can stand in for either engine.

``running`` counts requests holding a concurrency slot (``vllm`` mode: sequences the step scheduler
has admitted) and ``waiting`` those queued for one; KV
usage is used / capacity in [0, 1] (0 with the cache disabled). Built by hand: a dozen gauges do
not need a registry, and the text is cheap to format.
"""

from __future__ import annotations

from .engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(engine: Engine) -> str:
    counters = engine.kv.counters
    usage = counters.used / counters.capacity if counters.capacity > 0 else 0.0
    hit_rate = counters.hit_tokens / counters.query_tokens if counters.query_tokens else 0.0
    running = engine.running
    waiting = engine.waiting
    vllm = f'{{model_name="{_escape(engine.config.model)}"}}'
    sglang = f'{{model_name="{_escape(engine.config.model)}"}}'
    rows: list[tuple[str, str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "Requests holding a slot.", vllm, running),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting for a slot.", vllm, waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV cache usage, 1 means full.", vllm, usage),
        ("vllm:gpu_cache_usage_perc", "gauge", "KV cache usage (older vLLM name).", vllm, usage),
        (
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prompt tokens queried.",
            vllm,
            counters.query_tokens,
        ),
        ("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found cached.", vllm, counters.hit_tokens),
        (
            "vllm:request_success_total",
            "counter",
            "Requests that ended with their whole answer.",
            vllm,
            engine.requests_completed,
        ),
        (
            "vllm:prompt_tokens_total",
            "counter",
            "Prompt tokens of requests whose prefill completed.",
            vllm,
            engine.prompt_tokens_total,
        ),
        (
            "vllm:generation_tokens_total",
            "counter",
            "Tokens generated, counted as produced.",
            vllm,
            engine.generated_tokens_total,
        ),
        ("sglang:num_running_reqs", "gauge", "Requests holding a slot.", sglang, running),
        ("sglang:num_queue_reqs", "gauge", "Requests waiting for a slot.", sglang, waiting),
        ("sglang:token_usage", "gauge", "KV cache usage, 1 means full.", sglang, usage),
        ("sglang:max_total_num_tokens", "gauge", "KV cache capacity in tokens.", sglang, counters.capacity),
        ("sglang:cache_hit_rate", "gauge", "Prefix cache hit rate over prompt tokens.", sglang, hit_rate),
    ]
    lines: list[str] = []
    for name, kind, help_text, labels, value in rows:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{labels} {float(value)!r}")
    return "\n".join(lines) + "\n"
