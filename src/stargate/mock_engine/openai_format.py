"""OpenAI wire formats (mock-engine spec §5), pre-encoded so a streamed token is one concatenation.

Each stream object builds its constant JSON prefix once per request; a token chunk is then
``prefix + TOKEN_JSON[i % 30] + suffix``. Chunks carry ``created`` and ``system_fingerprint``
(the engine's backend id, for routers that strip headers); ``usage`` appears only in a final
chunk with empty ``choices`` when the request set ``stream_options.include_usage``.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from stargate.wire.limits import saturating_add

TOKENS: tuple[str, ...] = (
    "Hello", ",", " how", " can", " I", " help", " you", " today", "?", " I", " am", " a", " helpful",
    " AI", " assistant", ".", " Let", " me", " know", " what", " you", " need", ".", " I", "'m",
    " here", " to", " assist", " you", "!",
)  # fmt: skip
TOKEN_JSON: tuple[bytes, ...] = tuple(orjson.dumps(token) for token in TOKENS)
_CYCLE = "".join(TOKENS)
DONE = b"data: [DONE]\n\n"


def token_text(index: int) -> str:
    """The 0-based ``index``-th generated token."""
    return TOKENS[index % len(TOKENS)]


def content(n: int) -> str:
    """Concatenation of the first ``n`` tokens."""
    full, rest = divmod(n, len(TOKENS))
    return _CYCLE * full + "".join(TOKENS[:rest])


def _usage(input_tokens: int, output_tokens: int) -> bytes:
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
        input_tokens,
        output_tokens,
        saturating_add(input_tokens, output_tokens),
    )


class StreamFormat(Protocol):
    def preamble(self) -> bytes: ...

    def token(self, index: int) -> bytes: ...

    def finish(self, input_tokens: int, output_tokens: int) -> bytes: ...


class ChatStream:
    __slots__ = ("_head", "_prefix", "_role", "_usage")

    def __init__(self, ident: str, model: str, fingerprint: str, created: int, include_usage: bool) -> None:
        self._head = b'data: {"id":%s,"object":"chat.completion.chunk","created":%d,"model":%s,' % (
            orjson.dumps(ident),
            created,
            orjson.dumps(model),
        ) + b'"system_fingerprint":%s,' % orjson.dumps(fingerprint)
        self._prefix = self._head + b'"choices":[{"index":0,"delta":'
        self._role = self._prefix + b'{"role":"assistant"},"finish_reason":null}]}\n\n'
        self._usage = include_usage

    def preamble(self) -> bytes:
        return b""

    def token(self, index: int) -> bytes:
        chunk = self._prefix + b'{"content":' + TOKEN_JSON[index % 30] + b'},"finish_reason":null}]}\n\n'
        return self._role + chunk if index == 0 else chunk

    def finish(self, input_tokens: int, output_tokens: int) -> bytes:
        stop = self._prefix + b'{},"finish_reason":"stop"}]}\n\n'
        if self._usage:
            stop += self._head + b'"choices":[],"usage":' + _usage(input_tokens, output_tokens) + b"}\n\n"
        return stop + DONE


class CompletionsStream:
    __slots__ = ("_head", "_prefix", "_usage")

    def __init__(self, ident: str, model: str, fingerprint: str, created: int, include_usage: bool) -> None:
        self._head = b'data: {"id":%s,"object":"text_completion","created":%d,"model":%s,' % (
            orjson.dumps(ident),
            created,
            orjson.dumps(model),
        ) + b'"system_fingerprint":%s,' % orjson.dumps(fingerprint)
        self._prefix = self._head + b'"choices":[{"index":0,"text":'
        self._usage = include_usage

    def preamble(self) -> bytes:
        return b""

    def token(self, index: int) -> bytes:
        return self._prefix + TOKEN_JSON[index % 30] + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def finish(self, input_tokens: int, output_tokens: int) -> bytes:
        stop = self._prefix + b'"","logprobs":null,"finish_reason":"stop"}]}\n\n'
        if self._usage:
            stop += self._head + b'"choices":[],"usage":' + _usage(input_tokens, output_tokens) + b"}\n\n"
        return stop + DONE


def _response_object(ident: str, model: str, created: int, status: str) -> dict[str, Any]:
    return {"id": ident, "object": "response", "created_at": created, "status": status, "model": model}


def response_body(
    ident: str, model: str, created: int, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """The completed Responses-API object (also the non-streaming answer)."""
    body = _response_object(ident, model, created, "completed")
    body["output"] = [
        {
            "id": "msg-" + ident,
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": content(output_tokens), "annotations": []}],
        }
    ]
    body["usage"] = {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": saturating_add(input_tokens, output_tokens),
    }
    return body


class ResponsesStream:
    """The Responses API's event stream as OpenAI and vLLM send it: the response, its message item
    and text part announced before the first token (``response.output_text.delta`` each), each
    closed before ``response.completed``; every event numbered (``sequence_number``). The OpenAI
    SDK's ``responses.stream`` helper needs the item and part before the first delta."""

    __slots__ = ("_created", "_ident", "_item", "_model", "_prefix")

    _PREAMBLE = 4  # events before the first delta

    def __init__(self, ident: str, model: str, created: int) -> None:
        self._ident = ident
        self._model = model
        self._created = created
        self._item = "msg-" + ident
        self._prefix = (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","response_id":%s,'
            b'"item_id":%s,"output_index":0,"content_index":0,"logprobs":[],"sequence_number":'
            % (orjson.dumps(ident), orjson.dumps(self._item))
        )

    def preamble(self) -> bytes:
        response = _response_object(self._ident, self._model, self._created, "in_progress")
        response["output"] = []
        response["usage"] = None
        item: dict[str, Any] = {"id": self._item, "type": "message", "status": "in_progress"}
        item.update(role="assistant", content=[])
        return b"".join((
            _event(0, "response.created", response=response),
            _event(1, "response.in_progress", response=response),
            _event(2, "response.output_item.added", output_index=0, item=item),
            _event(3, "response.content_part.added", item_id=self._item, output_index=0, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": []}),
        ))  # fmt: skip

    def token(self, index: int) -> bytes:
        return self._prefix + b'%d,"delta":' % (self._PREAMBLE + index) + TOKEN_JSON[index % 30] + b"}\n\n"

    def finish(self, input_tokens: int, output_tokens: int) -> bytes:
        response = response_body(self._ident, self._model, self._created, input_tokens, output_tokens)
        item = response["output"][0]
        part = item["content"][0]
        seq = self._PREAMBLE + output_tokens
        text = {"item_id": self._item, "output_index": 0, "content_index": 0}
        return b"".join((
            _event(seq, "response.output_text.done", **text, text=part["text"], logprobs=[]),
            _event(seq + 1, "response.content_part.done", **text, part=part),
            _event(seq + 2, "response.output_item.done", output_index=0, item=item),
            _event(seq + 3, "response.completed", response=response),
        ))  # fmt: skip


def _event(sequence: int, kind: str, **fields: Any) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (
        kind.encode(),
        orjson.dumps({"type": kind, **fields, "sequence_number": sequence}),
    )


def chat_body(
    ident: str, model: str, fingerprint: str, created: int, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content(output_tokens)},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": saturating_add(input_tokens, output_tokens),
        },
    }


def completions_body(
    ident: str, model: str, fingerprint: str, created: int, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": 0, "text": content(output_tokens), "logprobs": None, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": saturating_add(input_tokens, output_tokens),
        },
    }


def embeddings_body(model: str, items: int, prompt_tokens: int, base64: bool) -> dict[str, Any]:
    data = [
        {
            "object": "embedding",
            "embedding": "AAAAAAAAAAA=" if base64 else [float(i), i + 0.125, -i - 0.25],
            "index": i,
        }
        for i in range(items)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
