"""Reconnect delays: capped exponential backoff with jitter.

The first delay is ``base_s`` (the spec's retry interval), then it doubles up to ``cap_s``; each
delay is stretched by a random 0..``jitter`` fraction so that many Pylons which lost the same
Stargate do not all come back in the same instant.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    base_s: float
    cap_s: float = 30.0
    jitter: float = 0.25
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self) -> float:
        """The delay before the next attempt; each call counts one more failure."""
        delay = min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return delay * (1.0 + self.jitter * self.rng.random())

    def reset(self) -> None:
        self.failures = 0
