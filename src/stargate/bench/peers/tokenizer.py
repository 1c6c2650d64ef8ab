"""A tiny, offline HuggingFace tokenizer directory for routers that insist on loading one.

Peer routers resolve ``--model-path`` / ``--tokenizer-path`` through the HuggingFace hub unless the
path is a local directory holding ``tokenizer.json``; on loopback there is no hub, so the bench
writes its own: a byte-level BPE with the 256 byte symbols of GPT-2's byte-to-unicode table and no
merges (every byte is one token, so any UTF-8 text encodes and decodes losslessly), a few special
tokens, a ChatML chat template in ``tokenizer_config.json`` and a minimal ``config.json``. The files
depend only on the model name, so a directory is written once and reused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """GPT-2's reversible byte → printable-unicode table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes, strict=True))
    return [chr(table[b]) for b in range(256)]


def tokenizer_json() -> dict[str, Any]:
    vocab = {symbol: index for index, symbol in enumerate(byte_symbols())}
    added = [{"id": 256 + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, tok in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def tokenizer_config(model: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_048_576,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "name_or_path": model,
        "added_tokens_decoder": {str(256 + i): {"content": tok, "special": True, "normalized": False,
                                                "lstrip": False, "rstrip": False, "single_word": False}
                                 for i, tok in enumerate(SPECIAL_TOKENS)},
    }


def model_config(model: str) -> dict[str, Any]:
    return {"architectures": ["MockForCausalLM"], "model_type": "mock", "name_or_path": model,
            "vocab_size": 256 + len(SPECIAL_TOKENS), "max_position_embeddings": 1_048_576,
            "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>")}


def write_tokenizer_dir(directory: Path, model: str) -> Path:
    """Write (or refresh) the tokenizer directory for ``model``; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": tokenizer_config(model),
        "special_tokens_map.json": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "config.json": model_config(model),
    }
    for name, content in files.items():
        data = orjson.dumps(content, option=orjson.OPT_INDENT_2)
        path = directory / name
        if path.is_file() and path.read_bytes() == data:
            continue
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return directory


def encode(text: str) -> list[int]:
    """The ids this tokenizer assigns to ``text`` (no special-token parsing): one per UTF-8 byte."""
    return list(text.encode())
