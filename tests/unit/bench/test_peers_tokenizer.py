from __future__ import annotations

from pathlib import Path

import orjson

from stargate.bench.peers.tokenizer import (
    SPECIAL_TOKENS,
    byte_symbols,
    encode,
    tokenizer_json,
    write_tokenizer_dir,
)


def test_byte_symbols_are_a_bijection_over_256_printable_characters() -> None:
    symbols = byte_symbols()
    assert len(symbols) == 256
    assert len(set(symbols)) == 256
    assert all(s.isprintable() and not s.isspace() for s in symbols)
    assert symbols[ord("a")] == "a"
    assert symbols[ord(" ")] == "Ġ"  # GPT-2's well-known mapping of the space byte


def test_tokenizer_json_is_byte_level_bpe_with_special_tokens_after_the_bytes() -> None:
    data = tokenizer_json()
    assert data["model"]["type"] == "BPE"
    assert data["model"]["merges"] == []
    assert len(data["model"]["vocab"]) == 256
    assert sorted(data["model"]["vocab"].values()) == list(range(256))
    assert [t["id"] for t in data["added_tokens"]] == [256, 257, 258]
    assert [t["content"] for t in data["added_tokens"]] == list(SPECIAL_TOKENS)
    assert data["pre_tokenizer"]["type"] == data["decoder"]["type"] == "ByteLevel"


def test_encode_is_one_id_per_utf8_byte() -> None:
    assert encode("hé") == [104, 0xC3, 0xA9]


def test_write_tokenizer_dir_writes_every_file_and_is_idempotent(tmp_path: Path) -> None:
    out = write_tokenizer_dir(tmp_path / "tok", "m/odel")
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = orjson.loads((out / "tokenizer_config.json").read_bytes())
    assert "<|im_start|>" in config["chat_template"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    write_tokenizer_dir(out, "m/odel")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
