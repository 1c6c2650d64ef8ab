"""The one exception hierarchy of the project.

StargateError
 ├── ConfigError          bad configuration; names the file, the field (JSON path) and the reason
 ├── RequestError         a client request that breaks the header/body contract (HTTP 4xx)
 └── UpstreamError        a backend or engine could not be reached or answered badly

Library errors (aiohttp, grpc, pydantic) are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations


class StargateError(Exception):
    """Base of every error this project raises on purpose."""


class ConfigError(StargateError):
    """A configuration value is invalid; ``path`` is the JSON path of the bad field."""

    def __init__(self, reason: str, *, path: str = "", file: str = "") -> None:
        self.reason = reason
        self.path = path
        self.file = file
        super().__init__(self.describe())

    def describe(self) -> str:
        where = ": ".join(part for part in (self.file, self.path) if part)
        return f"{where}: {self.reason}" if where else self.reason

    def in_file(self, file: str) -> ConfigError:
        return ConfigError(self.reason, path=self.path, file=file)


class RequestError(StargateError):
    """A request breaks the contract; carries the HTTP status and an optional error code."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        self.status = status
        self.message = message
        self.code = code
        super().__init__(message)


class UpstreamError(StargateError):
    """A backend could not be reached, or failed before answering."""
