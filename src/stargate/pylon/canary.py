"""Active bringup canaries (spec pylon.md §5.3).

While bringup is enabled, every admitted generation gets a loop: wait one interval, send a canary
(a short non-streaming chat), repeat every interval; a late tick fires at once and the next one is
an interval later (delay on miss). The first failure marks the generation bringup-not-ready, so it
is advertised ``INACTIVE`` while it stays routable for requests already sent to it. Recovery: a
health probe, then a canary, each retried after 1 s; when both pass the generation is ``ACTIVE``
again and periodic canaries resume. Canaries are not observed, and the engine's stats stream
events for them are dropped (spec §13 item 2 lets them in), so they leave Pylon's stats untouched.

Not in the original: a canary queued behind the engine's work is late, not failed. Its timeout
starts after the prompt work the engine had in hand when it was sent (``work_ahead``, at the
measured input rate, at most ``MAX_WORK_AHEAD_S``), and one that still gets no answer passes
while the engine produced output for other requests of the model meanwhile (``produced``), or
while a request sent to the engine before it still waits for its first output (``waiting``: an
engine prefilling a long prompt produces nothing), as long as that request has waited at most
``MAX_WORK_AHEAD_S`` and the run of canaries so excused began at most that long before, so an
engine that hangs with requests in flight is still found. Counted as
failures, every engine of a saturated fleet went ``INACTIVE`` at once and the routers answered the
requests they were holding 503; a 45k-token prompt prefilling at 1000 tokens/s, behind a Pylon
whose input rate was set 5x too high, took its engine out of routing mid-prefill, and the router
moved it to every backend in turn and answered 502.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp
import orjson

from stargate.pylon.calibration import engine_chat
from stargate.pylon.health import HealthProber
from stargate.pylon.ids import CANARY, RequestIds
from stargate.pylon.models import Generation, ModelRegistry
from stargate.wire.clock import Clock, SystemClock

log = logging.getLogger("stargate.pylon.canary")
CANARY_PROMPT = "1+1="
CANARY_INPUT_TOKENS = 4
RECOVERY_RETRY_S = 1.0
MAX_WORK_AHEAD_S = 120.0
"""The most a canary's timeout is extended for the work queued ahead of it, and the longest a
request still without output excuses a late canary: an engine that hangs with a deep queue is
still found (its health probes find one that stops answering at all)."""
LATE = "no answer within the timeout"
MAX_GENERATION_S = 600.0
"""The longest a streamed canary may take after its first byte, tokens coming or not."""
MAX_EVENT_BYTES = 64 * 1024
"""The longest event line a streamed canary reads (a token's chunk is well under 1 KiB)."""


def _completion_tokens(obj: object) -> int | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        return None
    return tokens


async def _streamed_tokens(resp: aiohttp.ClientResponse, threshold: int) -> int | str:
    """The completion tokens of a streamed answer (its usage event, else its chunks), or why it
    failed. Reading stops past the threshold: a runaway need not be read to its end."""
    usage: int | None = None
    chunks = 0
    async for raw in resp.content:  # one line each; longer than the reader's limit raises ValueError
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return "stream event is not JSON"
        tokens = _completion_tokens(obj)
        if tokens is not None:
            usage = tokens
        elif isinstance(obj, dict) and obj.get("choices"):
            chunks += 1
            if chunks > threshold:
                return threshold
    if usage is None and chunks == 0:
        return "stream has no usage.completion_tokens and no chunks"
    return usage if usage is not None else chunks


async def send_canary(
    session: aiohttp.ClientSession,
    base_url: str,
    request_id: str,
    gen: Generation,
    *,
    threshold: int,
    timeout_s: float,
) -> str | None:
    """One canary; None when it passed, else why it failed (transport, status, body, runaway).

    Streamed (not in the original, whose canary waits for the whole answer): ``timeout_s`` bounds
    the wait for the first byte and each wait for the next, so an engine that generates slowly but
    steadily passes, and one that stops generating fails as before. A whole answer took longer than
    the timeout on an engine below about 47 tokens/s (237 in 5 s): its model went INACTIVE, got no
    traffic, and its recovery canaries failed the same way for as long as it ran. An engine that
    ignores ``stream`` and answers JSON is read as before."""
    body, headers = engine_chat(
        gen.model_id,
        request_id,
        CANARY_PROMPT,
        max_tokens=threshold,
        input_tokens=CANARY_INPUT_TOKENS,
        stream=True,
    )
    answer: int | str
    try:
        async with session.post(
            base_url + "/v1/chat/completions",
            data=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s + MAX_GENERATION_S, sock_read=timeout_s),
            read_bufsize=MAX_EVENT_BYTES,
        ) as resp:
            if not 200 <= resp.status < 300:
                return f"HTTP {resp.status}"
            if resp.content_type == "text/event-stream":
                answer = await _streamed_tokens(resp, threshold)
            else:
                try:
                    obj = orjson.loads(await resp.read())
                except orjson.JSONDecodeError:
                    return "body is not JSON"
                tokens = _completion_tokens(obj)
                answer = "body has no usage.completion_tokens" if tokens is None else tokens
    except TimeoutError:
        return LATE
    except (aiohttp.ClientError, ValueError) as exc:
        return f"request failed: {exc!r}"
    if isinstance(answer, str):
        return answer
    tokens = answer
    if tokens >= threshold:
        return f"runaway generation ({tokens} tokens, the canary maximum)"
    return None


class CanaryRunner:
    """One canary loop per admitted generation; ``start``/``stop`` follow the model lifecycle."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        base_url: str,
        ids: RequestIds,
        registry: ModelRegistry,
        prober: HealthProber,
        interval_s: float,
        threshold: int,
        timeout_s: float,
        retry_s: float = RECOVERY_RETRY_S,
        clock: Clock | None = None,
        produced: Callable[[str, float], bool] = lambda _model_id, _seconds: False,
        work_ahead: Callable[[Generation], float] = lambda _gen: 0.0,
        waiting: Callable[[Generation], float | None] = lambda _gen: None,
        occupying: Callable[[Generation], contextlib.AbstractContextManager[None]] = (
            lambda _gen: contextlib.nullcontext()
        ),
    ) -> None:
        """``produced(model_id, seconds)``: whether the engine produced output for the model within
        the last ``seconds`` (``Relay.produced_within``); ``work_ahead(gen)``: seconds of prompt
        work ahead of a request sent now (``Relay.work_ahead_s``); ``waiting(gen)``: how long the
        oldest request sent to the engine still without output has waited, None when none has
        (``LiveLoad.oldest_wait_s``); ``occupying(gen)``: counts a canary in Pylon's admission while
        it runs (``LiveLoad.occupying``): it holds an engine slot that a request admitted beside it
        would otherwise be expected to find free."""
        self._session = session
        self._base = base_url
        self._ids = ids
        self._registry = registry
        self._prober = prober
        self._interval_s = interval_s
        self._threshold = threshold
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._clock = clock or SystemClock()
        self._produced = produced
        self._work_ahead = work_ahead
        self._waiting = waiting
        self._occupying = occupying
        self._tasks: dict[Generation, asyncio.Task[None]] = {}
        self._excused_since: dict[Generation, float] = {}  # first of a run of late canaries excused

    def start(self, gen: Generation) -> None:
        if self._interval_s <= 0 or gen in self._tasks:
            return
        loop = asyncio.get_running_loop()
        self._tasks[gen] = loop.create_task(self._loop(gen), name=f"canary-{gen.model_id}")

    def stop(self, gen: Generation) -> None:
        self._excused_since.pop(gen, None)
        task = self._tasks.pop(gen, None)
        if task is not None:
            task.cancel()

    async def canary(self, gen: Generation) -> str | None:
        """Why the canary failed, or None; a late one passes while the engine produces output or
        still works on a prompt sent before the canary."""
        timeout_s = self._timeout_s + min(self._work_ahead(gen), MAX_WORK_AHEAD_S)
        request_id = self._ids.new(CANARY, gen.seq)
        started = self._clock.monotonic()
        with self._occupying(gen):
            failure = await send_canary(
                self._session, self._base, request_id, gen, threshold=self._threshold, timeout_s=timeout_s
            )
        if failure is None or (failure == LATE and self._produced(gen.model_id, timeout_s)):
            if failure is not None:
                log.debug(
                    "canary for model %s queued past its timeout behind answered requests", gen.model_id
                )
            self._excused_since.pop(gen, None)
            return None
        if failure != LATE:
            return failure
        # Behind a prompt sent before it and still without output: late, for MAX_WORK_AHEAD_S from
        # the first canary so excused. Bounded by the request's age alone, a hung engine stayed in
        # routing for as long as its clients gave up and sent new requests.
        now = self._clock.monotonic()
        since = self._excused_since.setdefault(gen, now)
        waited = self._waiting(gen)
        if (
            waited is not None
            and now - started < waited <= MAX_WORK_AHEAD_S
            and now - since <= MAX_WORK_AHEAD_S
        ):
            log.debug(
                "canary for model %s queued past its timeout behind a request before its first output",
                gen.model_id,
            )
            return None
        return failure

    async def _loop(self, gen: Generation) -> None:
        clock = self._clock
        next_at = clock.monotonic() + self._interval_s
        while self._registry.is_current(gen):
            await clock.sleep(max(0.0, next_at - clock.monotonic()))
            next_at = max(next_at, clock.monotonic()) + self._interval_s
            failure = await self.canary(gen)
            if failure is None:
                continue
            log.warning("canary for model %s failed, advertising it INACTIVE: %s", gen.model_id, failure)
            self._registry.set_bringup_ready(gen, False)
            await self._recover(gen)
            if not self._registry.is_current(gen):
                return
            log.info("model %s passed its recovery canary, advertising it ACTIVE", gen.model_id)
            self._registry.set_bringup_ready(gen, True)
            next_at = clock.monotonic() + self._interval_s

    async def _recover(self, gen: Generation) -> None:
        while self._registry.is_current(gen):
            if await self._prober.probe(self._timeout_s) and await self.canary(gen) is None:
                return
            await self._clock.sleep(self._retry_s)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
