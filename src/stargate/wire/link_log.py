"""Reachability of one peer as the log tells it: one line per change, not one per retry.

A Stargate that Pylon cannot reach (or that refuses it), an engine whose stats stream or metrics
page fails: the first failure is a ``WARNING`` naming the peer and the reason, later ones while it
stays down are ``DEBUG`` unless their reason is new (a ``WARNING`` for each of the first
``MAX_REASONS``: an engine that came up serving another model's name was only ever logged as
unreachable), and the first success after a failure (or at all) is one ``INFO`` line.
"""

from __future__ import annotations

import logging

MAX_REASONS = 4
"""Different reasons told at ``WARNING`` in one outage; later new ones are ``DEBUG`` too."""


class LinkLog:
    __slots__ = ("_logger", "_peer", "_told", "_what", "up")

    def __init__(self, logger: logging.Logger, what: str, peer: str) -> None:
        self._logger = logger
        self._what = what
        self._peer = peer
        self._told: set[str] = set()
        self.up: bool | None = None

    def connected(self) -> None:
        if self.up is not True:
            self._logger.info("%s with %s established", self._what, self._peer)
        self.up = True
        self._told.clear()

    def failed(self, reason: str, retry_s: float) -> None:
        if self.up is True:
            self._logger.warning("%s with %s lost (%s); reconnecting", self._what, self._peer, reason)
        elif self.up is None:
            # The reason says whether the peer was unreachable or refused (an id already registered).
            message = "%s with %s failed (%s); retrying, first in %.1f s"
            self._logger.warning(message, self._what, self._peer, reason, retry_s)
        elif reason not in self._told and len(self._told) < MAX_REASONS:
            self._logger.warning("%s with %s still failing, now: %s", self._what, self._peer, reason)
        else:
            self._logger.debug("%s with %s still failing (%s)", self._what, self._peer, reason)
        if len(self._told) < MAX_REASONS:
            self._told.add(reason)
        self.up = False
