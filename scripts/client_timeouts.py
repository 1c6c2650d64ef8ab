"""Clients that give up: how many requests are answered, and how much engine work nobody reads.

Sends ``--requests`` chat requests at once through an OpenAI-compatible router with the ``openai``
client's own timeout and retries (the way applications call it), then reads the engines'
``vllm:generation_tokens_total`` (the mock engine and vLLM export it) and prints the answered
requests beside the tokens the engines generated and the tokens the answers carried.

Run against the README's quickstart fleet (router on :8000, engines on :8001 and :8002):

    .venv/bin/python scripts/client_timeouts.py --requests 300 --output-tokens 30 --timeout 6 --no-stream
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
import urllib.request

from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

SETTLE_S = 3.0  # requests cut by their client stop within this; what still runs counts as waste


def generated_tokens(metrics_urls: list[str]) -> float:
    total = 0.0
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("vllm:generation_tokens_total"):
                    total += float(line.split()[-1])
    return total


async def one(client: AsyncOpenAI, i: int, args: argparse.Namespace, out: collections.Counter[str]) -> None:
    tokens = args.output_tokens
    try:
        answer = await client.chat.completions.create(
            model=args.model,
            stream=args.stream,
            max_tokens=tokens,
            extra_headers={"x-output-tokens": str(tokens)},  # the mock engine's answer length
            messages=[{"role": "user", "content": f"q{i} " + "word " * 100}],
        )
        if args.stream:
            async for _ in answer:  # type: ignore[union-attr]
                pass
        out["answered"] += 1
    except APITimeoutError:
        out["timed out"] += 1
    except APIStatusError as exc:
        out[f"status {exc.status_code}"] += 1
    except APIConnectionError:
        out["connection error"] += 1


async def main(args: argparse.Namespace) -> None:
    before = generated_tokens(args.engine_metrics)
    client = AsyncOpenAI(
        base_url=args.base_url, api_key="unused", max_retries=args.retries, timeout=args.timeout
    )
    out: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    await asyncio.gather(*(one(client, i, args, out) for i in range(args.requests)))
    wall = time.perf_counter() - started
    await asyncio.sleep(SETTLE_S)
    generated = generated_tokens(args.engine_metrics) - before
    useful = out["answered"] * args.output_tokens
    print(f"{dict(out)} in {wall:.1f} s")
    print(f"engine tokens generated {generated:.0f}, in answers {useful} ({useful / max(generated, 1):.0%})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument(
        "--engine-metrics",
        nargs="+",
        default=["http://127.0.0.1:8001/metrics", "http://127.0.0.1:8002/metrics"],
    )
    parser.add_argument("--model", default="llama")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--output-tokens", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=6.0, help="the client's timeout per attempt, s")
    parser.add_argument("--retries", type=int, default=2, help="the client's retries after a failure")
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    asyncio.run(main(parser.parse_args()))
