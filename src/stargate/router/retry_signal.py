"""How an upstream answer reads for the retry rules (spec §4.8 step 5)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stargate.errors import QueueEstimateMismatch
from stargate.wire import headers as h

RETRYABLE_STATUSES = frozenset({429, 503})
MAX_RETRY_AFTER_MS = 3_600_000
"""A refusal's retry delay past an hour is not read (as an invalid one is not)."""
QUEUE_ESTIMATE_MISMATCH = QueueEstimateMismatch.code
DEFAULT_RETRY_REASON = "retryable_upstream_response"


@dataclass(frozen=True, slots=True)
class RetrySignal:
    """Retryable with a reason, whether this attempt's reservation ends now, and when the backend
    said to try it again (``x-stargate-retry-after-ms``, Pylon's form of the engine's
    ``Retry-After``)."""

    retryable: bool
    reason: str
    release_reservation: bool
    retry_after_ms: int | None = None


NOT_RETRYABLE = RetrySignal(False, DEFAULT_RETRY_REASON, False)


def retry_signal(status: int, header: Callable[[str], str | None], require_signal: bool) -> RetrySignal:
    """Retryable iff 429/503 and ``x-stargate-retryable: true`` (or absent when no signal is required).

    A 429 ``queue_estimate_mismatch`` releases the reservation whatever happens next: Pylon
    rejected it before its engine saw anything.
    """
    if 200 <= status < 300:
        return NOT_RETRYABLE
    flag = header(h.RETRYABLE)
    raw_reason = header(h.RETRY_REASON)
    reason = (raw_reason or "").strip() or DEFAULT_RETRY_REASON
    explicit_true = flag is not None and flag.strip().lower() == "true"
    release = status == 429 and explicit_true and reason == QUEUE_ESTIMATE_MISMATCH
    if status not in RETRYABLE_STATUSES:
        return RetrySignal(False, reason, release)
    retryable = explicit_true if flag is not None else not require_signal
    after = h.optional_unsigned(header(h.RETRY_AFTER_MS), MAX_RETRY_AFTER_MS) if retryable else None
    return RetrySignal(retryable, reason, release, after)
