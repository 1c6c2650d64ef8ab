"""Deterministic prompt text, so routers and engines that read text see real shared prefixes.

Token rule: 1 token = ``BYTES_PER_TOKEN`` (4) bytes of the chat prompt bytes the mock engine hashes
(``role`` NUL ``content`` NUL per message, see ``stargate.mock_engine.tokens``). The messages built
here make those bytes exactly ``4 x input_tokens`` long, so the engine's text estimate and the
``x-input-tokens`` header agree.

Each key (session, cache key, or the request id when there is none) owns an endless text stream
drawn from its own RNG: a unique header followed by sentences from a pool built from the seeded
vocabulary. A request with ``n`` tokens sends the first bytes of its key's stream, so a longer
request of the same key (a later turn) extends a shorter one byte for byte, while two different
keys diverge from their first block. An optional system prompt is shared by every request.
"""

from __future__ import annotations

import random
import string

from stargate.mock_engine.tokens import BYTES_PER_TOKEN

_POOL_SENTENCES = 1024
_CHUNK_SENTENCES = 64
_MAX_CACHED_KEYS = 65536
_MAX_CACHED_BLOCKS = 16384


def _role_overhead(role: str) -> int:
    return len(role) + 2  # role NUL content NUL


def vocabulary(size: int, seed: int) -> list[str]:
    """``size`` distinct lowercase pseudo-words of 2-9 letters, fixed by ``seed``."""
    rng = random.Random(f"stargate-bench:vocabulary:{seed}")
    words: dict[str, None] = {}
    while len(words) < size:
        words["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))] = None
    return list(words)


class PromptBuilder:
    """Builds chat ``messages`` of an exact token size from per-key deterministic streams."""

    def __init__(
        self,
        *,
        seed: int,
        vocabulary_size: int = 2048,
        vocabulary_seed: int = 0,
        shared_prefix_tokens: int = 0,
        repeat: bool = False,
    ) -> None:
        self._seed = seed
        self._repeat = repeat
        self._shared_tokens = shared_prefix_tokens
        words = vocabulary(vocabulary_size, vocabulary_seed)
        rng = random.Random(f"stargate-bench:sentences:{vocabulary_seed}")
        self._pool = [
            " ".join(rng.choices(words, k=rng.randint(6, 18))).capitalize() + ". "
            for _ in range(_POOL_SENTENCES)
        ]
        self._streams: dict[str, tuple[random.Random, list[str], int]] = {}
        self._blocks: dict[str, str] = {}
        self._system = self._stream_text("__shared_system_prompt__", shared_prefix_tokens * BYTES_PER_TOKEN)
        self._streams.clear()

    def _stream_text(self, key: str, length: int) -> str:
        """The first ``length`` characters of ``key``'s stream (cached and extended on demand)."""
        entry = self._streams.get(key)
        if entry is None:
            if len(self._streams) >= _MAX_CACHED_KEYS:
                self._streams.pop(next(iter(self._streams)))
            rng = random.Random(f"stargate-bench:prompt:{self._seed}:{key}")
            header = f"[{key}] "
            entry = (rng, [header], len(header))
        rng, parts, size = entry
        while size < length:
            chunk = "".join(rng.choices(self._pool, k=_CHUNK_SENTENCES))
            parts.append(chunk)
            size += len(chunk)
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        self._streams[key] = (rng, parts, size)
        return parts[0][:length]

    def block(self, key: str, length: int) -> str:
        """The first ``length`` characters of a text fixed by ``key`` and the seed (a trace block).

        Unlike the per-key streams, nothing is generated beyond what was asked; recent blocks are
        kept so a block shared by many prompts is built once.
        """
        text = self._blocks.get(key)
        if text is None or len(text) < length:
            rng = random.Random(f"stargate-bench:block:{self._seed}:{key}")
            parts = [f"[{key}] "]
            size = len(parts[0])
            while size < length:
                parts.append(rng.choice(self._pool))
                size += len(parts[-1])
            text = "".join(parts)
            if len(self._blocks) >= _MAX_CACHED_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[key] = text
        return text[:length]

    def messages(self, key: str, input_tokens: int) -> list[dict[str, str]]:
        total = max(1, input_tokens) * BYTES_PER_TOKEN
        if self._repeat:
            return [{"role": "user", "content": "x" * max(1, input_tokens)}]
        shared = self._shared_tokens
        messages: list[dict[str, str]] = []
        if shared > 0 and input_tokens > shared + 2:
            system_bytes = shared * BYTES_PER_TOKEN - _role_overhead("system")
            messages.append({"role": "system", "content": self._system[:system_bytes]})
            total -= shared * BYTES_PER_TOKEN
        user_bytes = max(1, total - _role_overhead("user"))
        messages.append({"role": "user", "content": self._stream_text(key, user_bytes)})
        return messages


def prompt_bytes_length(messages: list[dict[str, str]]) -> int:
    """Length of the engine's canonical prompt bytes for ``messages`` (ASCII text)."""
    return sum(_role_overhead(m["role"]) + len(m["content"].encode()) for m in messages)
