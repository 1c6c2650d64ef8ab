"""Decoded copies of compressed request bodies: bounded, and every bad input a 4xx error."""

from __future__ import annotations

import gzip
import zlib

import pytest

from stargate.body_coding import decoded
from stargate.errors import PayloadTooLarge, RequestError, UnsupportedEncoding

BODY = b'{"stream": true, "messages": []}'


def test_no_or_identity_encoding_is_the_body_itself() -> None:
    assert decoded(BODY, None, 100) is BODY
    assert decoded(BODY, " identity ", 100) == BODY


def test_gzip_and_deflate_decode_and_stack_in_reverse_order() -> None:
    assert decoded(gzip.compress(BODY), "GZIP", 100) == BODY
    assert decoded(zlib.compress(BODY), "deflate", 100) == BODY
    assert decoded(gzip.compress(zlib.compress(BODY)), "deflate, gzip", 100) == BODY


def test_corrupt_or_truncated_data_is_a_400() -> None:
    with pytest.raises(RequestError, match="not valid gzip") as info:
        decoded(b"not gzip at all", "gzip", 100)
    assert info.value.status == 400
    with pytest.raises(RequestError, match="truncated"):
        decoded(gzip.compress(BODY)[:-8], "gzip", 100)


def test_a_body_inflating_past_the_limit_is_a_413_without_inflating_it_all() -> None:
    bomb = gzip.compress(b"0" * 10_000_000)
    with pytest.raises(PayloadTooLarge) as info:
        decoded(bomb, "gzip", 1000)
    assert info.value.status == 413


def test_an_unknown_coding_is_a_415() -> None:
    with pytest.raises(UnsupportedEncoding) as info:
        decoded(BODY, "br", 100)
    assert info.value.status == 415
