"""Decoded copies of compressed request bodies: bounded, and every bad input a 4xx error."""

from __future__ import annotations

import asyncio
import gzip
import random
import threading
import zlib

import pytest
from multidict import CIMultiDict
from support.waiting import until

from stargate.body_coding import content_coding, decoded, off_loop
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


def test_a_body_inflating_past_a_hundred_times_its_size_is_a_413() -> None:
    """Bounded as zip-bomb guards bound it: 60 KB held 60 MiB of JSON, a second of parsing."""
    text = b"a" * (3 * 1024 * 1024)
    bomb = gzip.compress(text)  # about 3 KB
    with pytest.raises(PayloadTooLarge, match=f"inflates past 100 times its {len(bomb)} bytes"):
        decoded(bomb, "gzip", 64 * 1024 * 1024)
    assert decoded(gzip.compress(text[: 1024 * 1024]), "gzip", 64 * 1024 * 1024) == text[: 1024 * 1024]
    noise = random.Random(7).randbytes(2 * 1024 * 1024)  # incompressible: its own size, past the floor
    assert decoded(gzip.compress(text + noise), "gzip", 64 * 1024 * 1024) == text + noise


def test_every_gzip_member_is_decoded_and_bytes_after_the_data_are_a_400() -> None:
    """RFC 1952 bodies of several members decode to their concatenation (as ``gzip.decompress``
    reads them); trailing bytes were ignored by the check and forwarded to the engine."""
    assert decoded(gzip.compress(BODY[:10]) + gzip.compress(BODY[10:]), "gzip", 100) == BODY
    with pytest.raises(RequestError, match="not valid gzip"):
        decoded(gzip.compress(BODY) + b"NOT GZIP", "gzip", 100)
    with pytest.raises(RequestError, match="after its deflate data"):
        decoded(zlib.compress(BODY) + b"x", "deflate", 100)
    with pytest.raises(PayloadTooLarge):  # the limit counts every member
        decoded(gzip.compress(BODY) + gzip.compress(BODY), "gzip", len(BODY) + 5)


def test_a_rejected_body_keeps_no_decoded_copy_alive() -> None:
    """The error's traceback reaches no frame holding the inflated bytes: each rejected bomb kept
    its copy until the garbage collector's next full pass (twenty held 1.4 GB in Pylon)."""
    bomb = gzip.compress(b"0" * 2_000_000)
    for coding, body in (("gzip", bomb), ("gzip, gzip", gzip.compress(bomb))):
        with pytest.raises(PayloadTooLarge) as info:
            decoded(body, coding, 1_000_000)
        tb = info.value.__traceback__.tb_next  # past this test's own frame
        held = 0
        while tb is not None:
            held = max([held, *(len(v) for v in tb.tb_frame.f_locals.values() if isinstance(v, bytes))])
            tb = tb.tb_next
        assert held <= len(body)
        assert info.value.__cause__ is None and info.value.__context__ is None


def test_content_encoding_header_lines_are_one_list() -> None:
    headers = CIMultiDict([("Content-Encoding", "gzip"), ("content-encoding", "deflate")])
    assert content_coding(headers) == "gzip, deflate"
    assert content_coding(CIMultiDict()) is None
    assert content_coding({"content-encoding": "gzip"}) == "gzip"
    twice = content_coding(CIMultiDict([("content-encoding", "gzip")] * 2))
    assert decoded(gzip.compress(gzip.compress(BODY)), twice, 100) == BODY


def test_an_unknown_coding_is_a_415() -> None:
    with pytest.raises(UnsupportedEncoding) as info:
        decoded(BODY, "br", 100)
    assert info.value.status == 415


async def test_off_loop_reads_one_body_at_a_time_in_a_worker_while_the_loop_runs() -> None:
    """A compressed body is decoded and parsed away from the event loop, one at a time: its
    inflated copy is the only one held, and the process goes on serving meanwhile."""
    release = threading.Event()
    seen: list[str] = []

    def first() -> int:
        seen.append("first")
        assert release.wait(10)  # set by the event loop below: it is not blocked meanwhile
        seen.append("first done")
        return threading.get_ident()

    def second() -> int:
        seen.append("second")
        return threading.get_ident()

    reads = asyncio.gather(off_loop(first), off_loop(second))
    await until("the first read started", lambda: seen == ["first"])
    assert seen == ["first"]  # the second waits for it
    release.set()
    threads = await reads
    assert seen == ["first", "first done", "second"]
    assert threading.get_ident() not in threads
