"""Integer ranges of the wire contract, saturating arithmetic, and the size of remembered ids.

Every number that comes from a client or an engine is clamped where it enters a sum, a stats field
or a protobuf field: a u64 proto field given a larger value raises while the message is built.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import TypeVar

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I31_MAX = 2**31 - 1
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request body a hop holds: Stargate's replay buffer (default), Pylon's read limit, the
mock engine's (default). A body Stargate may replay must also fit through Pylon."""
MAX_BUFFERED_BODY_BYTES = 1024 * 1024 * 1024
"""Default room for the request bodies a Stargate or Pylon holds at once (``wire.body_budget``)."""
MAX_REQUEST_HEADER_FIELDS = 100
"""Header fields Stargate takes in a client's request. An aiohttp server (Pylon, the mock engine)
parses at most 128, and each hop adds its own (the plain-client headers, ``Via``, the expected
queue, a trace context, the engine's priority): a request at that limit was passed on and refused
by the next hop, its 400 blamed on the backend."""
HOP_HEADER_FIELDS = 12
"""Room for the header fields a hop adds: Pylon takes ``MAX_REQUEST_HEADER_FIELDS`` plus this many
(what a router added to a request it took), and an engine gets at most that plus Pylon's own."""
MAX_RESPONSE_HEADER_FIELDS = 128
"""Header fields a client session reads in an answer (aiohttp's own limit); Stargate reads
``HOP_HEADER_FIELDS`` more, for those Pylon adds relaying an engine's answer (``date``, ``server``,
``transfer-encoding``): an engine's answer of 126 fields reached Stargate with 131, unreadable,
and was sent again."""
MAX_PLAUSIBLE_TOKENS = 1 << 24
"""16 777 216 prompt tokens: above every model's context window. A throughput sample counting more
came from a client's claim or a faulty counter, not from an engine (Pylon's and Stargate's rates)."""
MAX_PLAUSIBLE_TPS = 1e8
"""Tokens per second of one engine, prefix-cache hits included; a faster sample is discarded."""


MAX_REMEMBERED_CHARS = 256
"""An id or key longer than this is remembered by its digest (``remembered``)."""


def remembered(text: str) -> str:
    """``text`` as a long-lived map holds it: a client's 8 KB header value by its SHA-256 digest,
    so a map capped by entries is capped in bytes too (65 536 such keys took a router to 645 MB)."""
    if len(text) <= MAX_REMEMBERED_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


_K = TypeVar("_K")
_V = TypeVar("_V")


def remember_newest(memory: OrderedDict[_K, _V], key: _K, value: _V, capacity: int) -> None:
    """``key`` as the most recently used entry of a bounded memory; past ``capacity`` entries the
    least recently used goes. An ``OrderedDict`` drops its oldest in O(1): a dict scans every slot
    its evictions left behind (60x a key past the cap)."""
    memory.pop(key, None)
    if len(memory) >= capacity:
        memory.popitem(last=False)
    memory[key] = value


def sat_u64(value: int) -> int:
    """``value`` clamped to ``0..=U64_MAX``."""
    if value > U64_MAX:
        return U64_MAX
    return value if value > 0 else 0


def sat_u32(value: int) -> int:
    if value > U32_MAX:
        return U32_MAX
    return value if value > 0 else 0


def saturating_add(value: int, delta: int) -> int:
    """u64 addition that clamps at the maximum instead of wrapping."""
    total = value + delta
    return total if total <= U64_MAX else U64_MAX


def u64_ceil(value: float) -> int:
    """``ceil(value)`` as a u64: NaN and negatives become 0, +inf and overflow the maximum."""
    if value != value or value <= 0:
        return 0
    if value >= U64_MAX or math.isinf(value):
        return U64_MAX
    return math.ceil(value)
