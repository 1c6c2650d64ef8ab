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
found by the digest of its last whole block, then checked at each length a prompt ending there has:
first by its last few characters, then exactly (its length and the digest of its whole text).
Memory is bounded: the least recently seen prompt is forgotten first, however many share a block
(every conversation of a template whose system prompt outlasts its first question ends its first
turn in one block).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from hashlib import blake2b

KEY_PREFIX = "prefix:"
BLOCK_CHARS = 512
"""Prompts shorter than this get no key: there is little cache to keep."""
CAPACITY = 65_536
"""Prompts remembered (about 60 MB), as many as the keys the balancer remembers (``PLACED_CAPACITY``)."""
TAIL_CHARS = 8
"""Last characters compared before a prompt's digest: most lengths in a crowded block fail there."""
MAX_CHECKS = 2048
MAX_DIGESTS = 32
"""One lookup looks at most ``MAX_CHECKS`` remembered lengths and computes at most ``MAX_DIGESTS``
digests, then gives up (a new key): prompts planted to share a text's blocks and last characters
made every lookup compute a digest per remembered length, 20 ms of the event loop for 8 KB."""
_DIGEST_BYTES = 16


class _Prompt:
    """A remembered prompt: the digest of its last whole block, its length and last characters, the
    digest of its whole text, its key, and whether a longer prompt has continued it."""

    __slots__ = ("continued", "end", "key", "length", "tail", "whole")

    def __init__(self, end: bytes, length: int, tail: str, whole: bytes, key: str) -> None:
        self.end, self.length, self.tail, self.whole, self.key = end, length, tail, whole, key
        self.continued = False


class PrefixKeys:
    """The prompts one router has seen, by the digest of their last whole block."""

    def __init__(self, capacity: int = CAPACITY, block_chars: int = BLOCK_CHARS) -> None:
        self._capacity = capacity
        self._block = block_chars
        self._lengths: dict[bytes, list[int]] = {}
        """digest of a last whole block -> the lengths of the prompts that end in it, ascending."""
        self._tails: dict[tuple[bytes, int], dict[str, int]] = {}
        """(last block, length) -> the last characters of the prompts that end there, and how many."""
        self._recent: OrderedDict[bytes, _Prompt] = OrderedDict()
        """Every prompt by its whole digest, least recently seen first."""

    def __len__(self) -> int:
        return len(self._recent)

    def key(self, text: str) -> str | None:
        """The key of the longest earlier prompt ``text`` continues, else a new one; None for a
        prompt shorter than a block and for one seen before as it is. ``text`` is remembered."""
        chain = _chain(text, self._block)
        if not chain:
            return None
        earlier = self._earlier(text, chain)
        if earlier is not None and earlier.length == len(text):
            self._recent.move_to_end(earlier.whole)
            return None  # a repeat, not a continuation: placed by load like a request without a key
        whole = _digest(chain[-1], text[len(chain) * self._block :])
        if earlier is None or earlier.continued:
            key = KEY_PREFIX + whole.hex()
        else:
            earlier.continued = True
            key = earlier.key
        self._remember(_Prompt(chain[-1], len(text), text[-TAIL_CHARS:], whole, key))
        return key

    def _earlier(self, text: str, chain: list[bytes]) -> _Prompt | None:
        """The longest remembered prompt that ``text`` starts with (itself included), within the
        lookup's budget."""
        tails, recent = self._tails, self._recent
        checks = digests = 0
        for index in range(len(chain) - 1, -1, -1):
            end = chain[index]
            lengths = self._lengths.get(end)
            if lengths is None:
                continue
            start = (index + 1) * self._block
            for at in range(bisect.bisect_right(lengths, len(text)) - 1, -1, -1):
                checks += 1
                if checks > MAX_CHECKS:
                    return None
                length = lengths[at]
                if text[length - TAIL_CHARS : length] in tails[end, length]:
                    digests += 1
                    if digests > MAX_DIGESTS:
                        return None
                    prompt = recent.get(_digest(end, text[start:length]))
                    if prompt is not None:
                        return prompt
        return None

    def _remember(self, prompt: _Prompt) -> None:
        shape = (prompt.end, prompt.length)
        tails = self._tails.get(shape)
        if tails is None:
            tails = self._tails[shape] = {}
            bisect.insort(self._lengths.setdefault(prompt.end, []), prompt.length)
        tails[prompt.tail] = tails.get(prompt.tail, 0) + 1
        self._recent[prompt.whole] = prompt
        while len(self._recent) > self._capacity:
            self._forget(self._recent.popitem(last=False)[1])

    def _forget(self, prompt: _Prompt) -> None:
        shape = (prompt.end, prompt.length)
        tails = self._tails[shape]
        if tails[prompt.tail] > 1:
            tails[prompt.tail] -= 1
            return
        del tails[prompt.tail]
        if tails:
            return
        del self._tails[shape]
        lengths = self._lengths[prompt.end]
        lengths.remove(prompt.length)
        if not lengths:
            del self._lengths[prompt.end]


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
