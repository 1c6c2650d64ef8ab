"""Plain-client mode: fill the spec's required headers for clients that send only OpenAI requests.

A gateway normally sets ``x-request-id``, ``x-model`` and ``x-input-tokens`` (spec §4.2). Without
one, ``stargate --plain-clients`` completes a request whose headers are missing: a request id is
generated, the model comes from the body's ``model``, the input tokens are counted from the prompt
(with a configured tokenizer, else one token per ``bytes_per_token`` UTF-8 bytes, rounded up), and
the ``--plain-client-session-header`` value (then the body's ``prompt_cache_key``) becomes the
cache-affinity key; without either, a prompt that starts with a whole earlier prompt gets that
prompt's key (``prefix_keys``: the next turn of a conversation), and the body's ``user`` is the
key of what the text gives none. The body is read,
with a size cap, only when ``x-model`` or ``x-input-tokens`` is missing: a request carrying the
headers is forwarded exactly as without the mode and its body is never parsed.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson
from aiohttp import web
from multidict import CIMultiDict

from stargate.body_coding import content_coding, decoded, off_loop
from stargate.errors import ConfigError, PayloadTooLarge, RequestError
from stargate.router.prefix_keys import PrefixKeys
from stargate.wire import headers as h
from stargate.wire import json_body
from stargate.wire.body_budget import UNCAPPED, BodyBudget
from stargate.wire.client_faults import detail
from stargate.wire.headers import is_visible_ascii, text_value

MAX_BODY_KEY_CHARS = 1024
"""Longer keys from a body are sent as their digest: Pylon publishes the routes of keys up to this
length, and every hop limits a header line to 8 190 bytes."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BYTES_PER_TOKEN = 4
REQUEST_ID_PREFIX = "sg-"
# Body fields that hold the prompt, what stays the same from turn to turn first (the Responses API's
# instructions): a conversation's prompt text then grows at its end.
PROMPT_FIELDS = ("instructions", "messages", "prompt", "input")
TOOL_FIELDS = ("tools", "functions")
"""Tool definitions (``functions``: chat's older form), counted in the prompt's tokens."""
# Inside messages/parts, only these keys carry prompt text (roles, types and ids do not); an
# assistant turn's tool calls carry theirs in ``tool_calls[].function.arguments`` (chat's older
# form: ``function_call.arguments``), which went uncounted (44 KB of arguments as 3 tokens).
TEXT_KEYS = frozenset(
    {"content", "text", "input", "output", "arguments", "tool_calls", "function", "function_call"}
)


class TokenCounter(Protocol):
    def count(self, text: str) -> int: ...


@dataclass(frozen=True, slots=True)
class BytesPerToken:
    """The documented estimate without a tokenizer: ceil(UTF-8 bytes / ``bytes_per_token``)."""

    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN

    def count(self, text: str) -> int:
        return -(-len(text.encode()) // self.bytes_per_token)


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` (or a directory holding one) loaded with the ``tokenizers`` package."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ConfigError(
                "needs the tokenizers package (pip install 'stargate-router[tokenizer]')",
                path="--plain-client-tokenizer",
            ) from exc
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own untyped errors
            raise ConfigError(f"cannot load {file}: {exc}", path="--plain-client-tokenizer") from exc

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True, slots=True)
class PlainClientSettings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    session_header: str | None = h.SESSION_ID
    tokenizer_path: str | None = None
    prefix_keys: bool = True

    def counter(self) -> TokenCounter:
        if self.tokenizer_path:
            return HuggingFaceTokenizer(self.tokenizer_path)
        return BytesPerToken(self.bytes_per_token)


def _too_large(size: int | str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"request body of {size} bytes is over --plain-client-max-body-bytes ({limit}); "
        "send x-model and x-input-tokens headers to forward it unparsed"
    )


class PlainClients:
    """The hook of the request-parsing path; built once at startup."""

    def __init__(
        self,
        settings: PlainClientSettings,
        counter: TokenCounter | None = None,
        budget: BodyBudget = UNCAPPED,
    ) -> None:
        self.settings = settings
        self._budget = budget
        self._counter = counter or settings.counter()
        self._session_header = settings.session_header
        self._prefixes = PrefixKeys() if settings.prefix_keys else None

    def incomplete(self, headers: Mapping[str, str]) -> bool:
        """True when a header this mode fills is missing (a few dictionary lookups)."""
        return (
            headers.get(h.INPUT_TOKENS) is None
            or text_value(headers.get(h.MODEL)) is None
            or text_value(headers.get(h.REQUEST_ID)) is None
            or (
                self._session_header is not None
                and self._session_header in headers
                and text_value(headers.get(h.CACHE_AFFINITY_KEY)) is None
            )
        )

    async def complete(self, request: web.Request) -> tuple[CIMultiDict[str], bytes | None]:
        """The request's headers with the missing ones filled, and its body when it had to be read
        (holding ``len(body)`` bytes of the budget, for the caller to give back)."""
        headers = CIMultiDict(request.headers)
        if text_value(headers.get(h.REQUEST_ID)) is None:
            headers[h.REQUEST_ID] = new_request_id()
        if text_value(headers.get(h.CACHE_AFFINITY_KEY)) is None and self._session_header is not None:
            session = body_key(headers.get(self._session_header))  # a non-ASCII id keeps its key too
            if session is not None:
                headers[h.CACHE_AFFINITY_KEY] = session
        if headers.get(h.INPUT_TOKENS) is not None and text_value(headers.get(h.MODEL)) is not None:
            return headers, None
        raw = await self._read(request)
        try:
            # A compressed body is read decoded and forwarded as received (bytes in, bytes out).
            coding = content_coding(headers)
            parse = functools.partial(_json_object, raw, coding, self.settings.max_body_bytes)
            self._fill(headers, await off_loop(parse) if coding else parse(), request.path)
        except BaseException:
            self._budget.give(len(raw))
            raise
        return headers, raw

    def _fill(self, headers: CIMultiDict[str], body: dict[str, Any], path: str = "") -> None:
        if text_value(headers.get(h.MODEL)) is None:
            model = body.get("model")
            value = text_value(model) if isinstance(model, str) else None
            if value is None:
                if isinstance(model, str) and model.strip(" \t"):
                    # Model ids travel as a header value to Pylon and the engine.
                    raise RequestError(f"the body's model is not a model id (visible ASCII): {model[:100]!r}")
                raise RequestError(
                    "the request names no model: set the body's model field or an x-model header"
                )
            headers[h.MODEL] = value
        text: str | None = None  # the prompt is walked only when a header needs it, and once
        if headers.get(h.INPUT_TOKENS) is None:
            text, token_ids = _prompt(body)
            headers[h.INPUT_TOKENS] = str(self._count(text, token_ids) + self._tool_tokens(body))
        if text_value(headers.get(h.CACHE_AFFINITY_KEY)) is None:
            key = body_key(body.get("prompt_cache_key"))
            if key is None:
                key = self._conversation_key(body, text, stored=_stored_response(path, body))
            if key is not None:
                headers[h.CACHE_AFFINITY_KEY] = key

    def _conversation_key(self, body: Mapping[str, Any], text: str | None, *, stored: bool) -> str | None:
        """The conversation the prompt continues (``prefix_keys``), else the body's ``user``.
        OpenAI's ``prompt_cache_key`` names a conversation and replaces ``user`` for caching;
        ``user`` names an end user or an account, and an app that sends one constant made every
        conversation one key, its turns bouncing between the replicas of its group. A Responses
        request the engine stores (``stored``) keys by its ``user`` first: a later turn may name it
        by ``previous_response_id``, which the text cannot follow, and an engine that keeps its
        responses in its own process (vLLM) answers 404 on another replica; the first turn of such
        a chain does not say it is one."""
        user = body_key(body.get("user"))
        if self._prefixes is None or (user is not None and stored):
            return user
        key = self._prefixes.key(_prompt(body)[0] if text is None else text)
        return user if key is None else key

    def input_tokens(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens of an OpenAI request body (at least 1)."""
        return self._count(*_prompt(body)) + self._tool_tokens(body)

    def _tool_tokens(self, body: Mapping[str, Any]) -> int:
        """The tool definitions, which the engine's chat template puts in the prompt: counted by
        their names and values (an agent's 37 KB of tool schemas was counted as no work at all),
        though not part of the text that keys a conversation."""
        tools = [body[name] for name in TOOL_FIELDS if body.get(name)]
        return self._counter.count(" ".join(_words(tools))) if tools else 0

    def _count(self, text: str, token_ids: int) -> int:
        return max(1, (self._counter.count(text) if text else 0) + token_ids)

    def check_declared(self, request: web.BaseRequest) -> None:
        """Raises ``PayloadTooLarge`` for a body declared larger than this mode reads."""
        limit = self.settings.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise _too_large(declared, limit)

    async def _read(self, request: web.Request) -> bytes:
        """The whole body, holding ``len(body)`` bytes of the budget (``BodyBudget.read_whole``)."""
        self.check_declared(request)
        limit = self.settings.max_body_bytes
        try:
            return await self._budget.read_whole(request, limit)
        except PayloadTooLarge:  # chunked: nothing declared (a length is exact, aiohttp's check)
            raise _too_large(f"more than {limit}", limit) from None


def _stored_response(path: str, body: Mapping[str, Any]) -> bool:
    """A Responses request whose answer the engine keeps for a later ``previous_response_id``."""
    return path.endswith("/responses") and body.get("store") is not False


def new_request_id() -> str:
    """An id for a plain client's request that came without one."""
    return REQUEST_ID_PREFIX + uuid.uuid4().hex


def body_key(value: object) -> str | None:
    """The cache-affinity key a body field gives: a string, trimmed, as is when it is a short
    visible-ASCII header value, else its SHA-256 digest, so a long or non-ASCII id (``"josé"``)
    still keeps its requests together; None for a blank or non-string value."""
    if not isinstance(value, str):
        return None
    trimmed = value.strip()
    if not trimmed:
        return None
    if len(trimmed) <= MAX_BODY_KEY_CHARS and is_visible_ascii(trimmed):
        return trimmed
    return "sha256:" + hashlib.sha256(trimmed.encode("utf-8", "surrogatepass")).hexdigest()


def _json_object(raw: bytes, coding: str | None, limit: int) -> dict[str, Any]:
    why = "(read because x-model or x-input-tokens is missing)"
    try:
        body = json_body.loads(decoded(raw, coding, limit))
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"the request body is not valid JSON: {detail(exc)} {why}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object {why}")
    return body


def _prompt(body: Mapping[str, Any]) -> tuple[str, int]:
    """The prompt's text, its parts joined by newlines, and its count of literal token ids."""
    texts: list[str] = []
    token_ids = 0
    for name in PROMPT_FIELDS:
        token_ids += _collect(body.get(name), texts)
    return "\n".join(texts), token_ids


def _words(value: Any) -> list[str]:
    """Every name and value under ``value`` as text, walked with a stack: ``orjson.dumps`` stops
    at 255 levels where the parser takes 1 024, and a deeper tool schema was a 500."""
    words: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            words.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif item is not None:
            words.append(item if isinstance(item, str) else str(item))
    return words


def _collect(value: Any, texts: list[str]) -> int:
    """Append prompt strings under ``value`` to ``texts`` in order; returns the count of literal
    token ids. Walked with a stack, not recursion: a body nests as deep as the JSON parser allows
    (1 024 levels), past Python's recursion limit. Written flat (exact types, empty containers
    skipped): a body of millions of tiny values is walked on the event loop."""
    token_ids = 0
    stack = [value]
    pop, extend, add = stack.pop, stack.extend, texts.append
    while stack:
        item = pop()
        kind = type(item)
        if kind is str:
            add(item)
        elif not item:
            continue
        elif kind is list:
            for part in item:
                if type(part) is not int:  # bool is not a token id either
                    extend(reversed(item))
                    break
            else:
                token_ids += len(item)  # a pre-tokenized prompt
        elif kind is dict:
            extend(reversed([part for key, part in item.items() if key in TEXT_KEYS]))
    return token_ids
