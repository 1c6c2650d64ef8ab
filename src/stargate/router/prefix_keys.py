"""Cache-affinity keys for plain clients that send none, from their prompt text.

A conversation (a chat, an agent's session) re-sends its history: each turn's prompt starts with the
whole prompt of the turn before. A request whose prompt starts with the whole prompt of a request
seen before, and goes on past it, continues that request and gets its key, so it goes where that
prompt is cached; any other request starts a key of its own. Only a whole earlier prompt counts:
requests that share a long system prompt and differ after it are not one conversation, and one key
for all of them would hold them all on one replica. A conversation's turn is continued once, by its
next turn; a prompt continued a second way is a shared opening (a template's system prompt sent
alone once, a canned first question), so only its first continuation keeps its key and each later
one starts its own. A prompt sent again as it is (a load test's, a canned question, a retry) gets
no key: its copies are placed by load, each replica caching it once, rather than queued on one.

Prompts are indexed by a chain of digests over fixed blocks of characters; an earlier prompt is
found by the digest of its last whole block, then checked exactly (its length and the digest of its
whole text). Memory is bounded: the least recently seen block is forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from hashlib import blake2b

KEY_PREFIX = "prefix:"
BLOCK_CHARS = 512
"""Prompts shorter than this get no key: there is little cache to keep."""
CAPACITY = 65_536
"""Prompts remembered (about 27 MB), as many as the keys the balancer remembers (``PLACED_CAPACITY``)."""
PER_BLOCK = 16
"""Prompts remembered per last block: requests that differ only in a short tail share one."""
_DIGEST_BYTES = 16


class _Prompt:
    """A remembered prompt: its length, the digest of its whole text, its key, and whether a
    longer prompt has continued it."""

    __slots__ = ("continued", "key", "length", "whole")

    def __init__(self, length: int, whole: bytes, key: str) -> None:
        self.length, self.whole, self.key = length, whole, key
        self.continued = False


class PrefixKeys:
    """The prompts one router has seen, by the digest of their last whole block."""

    def __init__(self, capacity: int = CAPACITY, block_chars: int = BLOCK_CHARS) -> None:
        self._capacity = capacity
        self._block = block_chars
        self._ends: OrderedDict[bytes, list[_Prompt]] = OrderedDict()
        """digest of a prompt's last whole block -> the prompts that end in it, newest last."""
        self._prompts = 0
        """Prompts in ``_ends``, which ``capacity`` bounds (a block holds up to ``PER_BLOCK``)."""

    def __len__(self) -> int:
        return len(self._ends)

    def key(self, text: str) -> str | None:
        """The key of the longest earlier prompt ``text`` continues, else a new one; None for a
        prompt shorter than a block and for one seen before as it is. ``text`` is remembered."""
        chain = _chain(text, self._block)
        if not chain:
            return None
        whole = _digest(chain[-1], text[len(chain) * self._block :])
        earlier = self._earlier(text, chain)
        if earlier is not None and earlier.length == len(text):
            self._remember(chain[-1], earlier)
            return None  # a repeat, not a continuation: placed by load like a request without a key
        if earlier is None or earlier.continued:
            key = KEY_PREFIX + whole.hex()
        else:
            earlier.continued = True
            key = earlier.key
        self._remember(chain[-1], _Prompt(len(text), whole, key))
        return key

    def _earlier(self, text: str, chain: list[bytes]) -> _Prompt | None:
        """The longest remembered prompt that ``text`` starts with."""
        ends = self._ends
        for index in range(len(chain) - 1, -1, -1):
            entries = ends.get(chain[index])
            if entries is None:
                continue
            start = (index + 1) * self._block
            for prompt in reversed(entries):
                if (
                    prompt.length <= len(text)
                    and _digest(chain[index], text[start : prompt.length]) == prompt.whole
                ):
                    return prompt
        return None

    def _remember(self, end: bytes, prompt: _Prompt) -> None:
        ends = self._ends
        old = ends.pop(end, [])
        entries = [e for e in old if e.whole != prompt.whole]
        entries.append(prompt)
        if len(entries) > PER_BLOCK:
            del entries[0]
        self._prompts += len(entries) - len(old)
        while self._prompts > self._capacity and ends:  # the least recently seen ends go first
            self._prompts -= len(ends.popitem(last=False)[1])
        ends[end] = entries


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _digest(prefix: bytes, tail: str) -> bytes:
    return blake2b(prefix + _encode(tail), digest_size=_DIGEST_BYTES).digest()


def _chain(text: str, block: int) -> list[bytes]:
    """Digest ``i`` covers ``text[: (i + 1) * block]``: each chains the one before."""
    digests: list[bytes] = []
    previous = b""
    for start in range(0, len(text) - block + 1, block):
        previous = _digest(previous, text[start : start + block])
        digests.append(previous)
    return digests
