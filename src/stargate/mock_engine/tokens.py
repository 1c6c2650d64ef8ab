"""Token counts of the mock engine: header overrides, prompt-text estimates and the prompt bytes.

Two estimates exist. The original's (one token per UTF-8 byte, with the per-endpoint rules of the
mock-engine spec §4.1) is kept for the `affinity` KV mode so its numbers stay reproducible. The
`prefix` KV mode needs a text→token map it can also cut into blocks, so it uses one token per
``BYTES_PER_TOKEN`` bytes of the canonical prompt bytes (rounded up).
"""

from __future__ import annotations

from typing import Any

import orjson

from stargate.wire.headers import optional_unsigned
from stargate.wire.limits import U64_MAX

BYTES_PER_TOKEN = 4


def parse_token_header(value: str | None) -> int | None:
    """An unsigned 64-bit decimal header value, or None when absent or unparsable (no trimming, no
    sign); the range check is the shared parser's, which never hands ``int()`` thousands of digits."""
    if value is None or not value.isascii() or not value.isdigit():
        return None
    return optional_unsigned(value, U64_MAX)


def output_tokens(header: int | None, max_tokens: Any, num_tokens: int) -> int:
    """The header wins (≥ 1); else a request can shorten but never lengthen the default."""
    if header is not None:
        return max(1, header)
    default = max(1, num_tokens)
    requested = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else default
    return max(1, min(requested, default))


def _compact(value: Any) -> int:
    return len(orjson.dumps(value))


def chat_input_estimate(messages: Any) -> int:
    """Σ byte length of string contents, at least the number of messages, at least 1."""
    if not isinstance(messages, list):
        return 1
    total = 0
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str):
                total += len(content.encode())
    return max(total, len(messages), 1)


def responses_input_estimate(value: Any) -> int:
    if value is None:
        return 1
    if isinstance(value, str):
        return max(1, len(value.encode()))
    if isinstance(value, list):
        total = sum(len(item.encode()) if isinstance(item, str) else _compact(item) for item in value)
        return max(1, total)
    return max(1, _compact(value))


def completions_input_estimate(prompt: Any) -> int:
    if isinstance(prompt, str):
        return max(1, len(prompt.encode()))
    if isinstance(prompt, list):
        total = sum(len(item.encode()) if isinstance(item, str) else 1 for item in prompt)
        return max(1, total)
    return 1


def embeddings_item_count(value: Any) -> int:
    if isinstance(value, list):
        if all(_is_number(item) for item in value):
            return min(len(value), 1)
        return len(value)
    return 1


def embeddings_input_estimate(value: Any) -> int:
    if isinstance(value, str):
        return max(1, len(value.encode()))
    if isinstance(value, list):
        total = 0
        for item in value:
            if isinstance(item, str):
                total += max(len(item.encode()), 1)
            elif isinstance(item, list):
                total += max(len(item), 1)
            else:
                total += 1
        return max(1, total)
    return 1


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text_of(value: Any) -> bytes:
    """The text parts under ``value``, in order. Walked with a stack, not recursion: a body nests
    as deep as the JSON parser allows (1 024 levels), past Python's recursion limit."""
    parts: list[bytes] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            parts.append(item.encode())
        elif isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            text = item.get("text")
            if isinstance(text, str):
                parts.append(text.encode())
            else:
                stack.append(item.get("content"))
    return b"".join(parts)


def chat_prompt_bytes(messages: Any) -> bytes:
    """Canonical prompt bytes: per message ``role`` NUL ``text`` NUL, text parts concatenated.

    The role is part of the bytes (as a chat template would make it) so a shared system prompt
    followed by different user turns shares exactly its leading blocks.
    """
    if not isinstance(messages, list):
        return b""
    parts: list[bytes] = []
    for message in messages:
        if isinstance(message, dict):
            role = message.get("role")
            parts.append(role.encode() if isinstance(role, str) else b"")
            parts.append(b"\x00")
            parts.append(_text_of(message.get("content")))
            parts.append(b"\x00")
    return b"".join(parts)


def raw_prompt_bytes(value: Any) -> bytes:
    """Prompt bytes of `/v1/completions` `prompt` or `/v1/responses` `input` (text parts only)."""
    if isinstance(value, list) and all(isinstance(item, dict) and "role" in item for item in value):
        return chat_prompt_bytes(value)
    return _text_of(value)


def instructions_bytes(instructions: Any) -> bytes:
    """A Responses request's ``instructions`` as the system message they are to an engine's chat
    template: prompt work, cached as the leading blocks every turn re-sends."""
    if not isinstance(instructions, str) or not instructions:
        return b""
    return chat_prompt_bytes([{"role": "system", "content": instructions}])


def text_token_estimate(prompt: bytes) -> int:
    """Tokens of the prefix-mode approximation: ceil(bytes / BYTES_PER_TOKEN), at least 1."""
    return max(1, -(-len(prompt) // BYTES_PER_TOKEN))
