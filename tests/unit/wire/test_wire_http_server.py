"""The aiohttp internals ``GuardedRequestHandler`` reads: an aiohttp upgrade that renames one
fails here, by name, instead of silently switching a client deadline off."""

from __future__ import annotations

from aiohttp.web_protocol import RequestHandler

from stargate.wire.http_server import GuardedRequestHandler


def test_the_aiohttp_connection_state_the_client_deadlines_read_exists() -> None:
    slots: set[str] = set()
    for cls in RequestHandler.__mro__:
        slots.update(getattr(cls, "__slots__", ()))
    needed = ("_waiter", "_messages", "_current_request", "_reading_paused", "_buffer_paused")
    assert [name for name in needed if name not in slots] == []
    assert isinstance(RequestHandler.writing_paused, property)
    assert issubclass(GuardedRequestHandler, RequestHandler)
