"""The one exception hierarchy of the project.

StargateError                      status 500 internal_error: anything raised on purpose
 ├── ConfigError                   bad configuration; names the file, the field (JSON path) and the reason
 ├── RoutingMethodError            400 invalid_request: an ``x-routing-method`` the balancer cannot use
 │    │                            (the balancer's own error, not a RequestError subclass)
 │    ├── UnknownRoutingMethod     blank or names no algorithm
 │    └── UnavailableRoutingMethod an algorithm the configuration does not offer for the model
 ├── RequestError                  400 invalid_request: a client request breaks the header/body contract
 │    ├── PayloadTooLarge          413 payload_too_large: declared or buffered body over a limit
 │    ├── UnsupportedEncoding      415 unsupported_content_encoding: a body Pylon cannot check
 │    └── FaultError               400 invalid_fault: a mock engine test-control body (plain-text answer)
 ├── ModelNotFound                 404 model_not_found: ``GET /v1/models/{id}`` of a model nobody serves
 ├── RoutingError                  503 no_selectable_backend: no backend could be chosen
 │    ├── NoEligibleCandidates     404 no_eligible_candidates (spec §4.6 body, error-code header)
 │    └── InputWorkLimitExceeded   503 input_work_limit_exceeded (spec §4.6 body, error-code header)
 ├── UpstreamError                 502 upstream_transport_error: a backend could not be reached or broke
 │    ├── UpstreamNotSent          the request never left (connect refused/failed): safe to resend anywhere
 │    └── UpstreamTimeout          no response headers in time: the backend may still be executing it
 ├── BackendRejected               a backend's refusals before anything ran (carry x-stargate-retry-* headers)
 │    ├── ModelNotAdmitted         503 model_generation_unavailable
 │    ├── RequestLoop              503 request_loop: back at a router it passed (``Via``), retryable
 │    ├── QueueEstimateMismatch    429 queue_estimate_mismatch (extra fields of pylon.md §8.3)
 │    └── LocalConnectFailure      503 local_connect_failure: the engine was not reached or gave no answer
 ├── RegistrationRejected          a gRPC registration breaks the contract: the stream ends INVALID_ARGUMENT
 ├── StartupError                  Pylon could not become ready (never an HTTP response)
 │    └── CalibrationError         the input-TPS calibration ramp produced no usable figure
 ├── DiscoveryError                a discovery poll failed: Pylon's model list
 │    └── DiscoveryFailed          Stargate's peer DNS lookup (the caller publishes itself only)
 ├── ProcessError                  a bench fleet process failed to start or died
 └── PeerInstallError              a peer router for the bench could not be installed

Private control-flow signals that never leave their module stay beside it, each saying so:
``PromptTooLong`` (pylon/calibration.py), ``EventTooLarge`` (wire/sse.py), ``QueueFull``
(mock_engine/steps.py), ``_StreamEnd`` (router/control_plane.py: how a registration stream ends with
its gRPC status), ``InvalidNumber`` (wire/headers.py, always re-raised as a ``RequestError``).

Every class carries its HTTP ``status``, its error ``code`` (the ``x-stargate-error-code`` value for
the two codes the spec puts on the wire) and a ``message``; ``stargate.responses.error_response``
is the one function that turns any of them into an HTTP response. Library errors (aiohttp, grpc,
pydantic) are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from stargate.wire import headers as h
from stargate.wire.client_faults import detail

if TYPE_CHECKING:
    from stargate.balancer.settings import Algorithm


class StargateError(Exception):
    """Base of every error this project raises on purpose."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    kind: ClassVar[str] = "server_error"
    """The OpenAI error ``type`` of the response body."""
    wire_code: ClassVar[bool] = False
    """True for the codes spec §4.6 sends as ``x-stargate-error-code`` with its fixed body."""

    def __init__(self, message: str = "") -> None:
        self.message = message
        super().__init__(message)

    def retry_headers(self) -> Mapping[str, str]:
        """Headers that tell the caller whether and when to retry: Stargate whether to go elsewhere
        (Pylon's refusals), a client when (Stargate's refusals that backends timed)."""
        return {}

    def extra_fields(self) -> Mapping[str, object]:
        """Spec-fixed fields a problem body carries beside the standard ones."""
        return {}


class ConfigError(StargateError):
    """A configuration value is invalid; ``path`` is the JSON path of the bad field."""

    code = "config_error"

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


class RoutingMethodError(StargateError):
    """The balancer cannot use the requested routing method; the router answers 400."""

    status = 400
    code = "invalid_request"
    kind = "invalid_request_error"


class UnknownRoutingMethod(RoutingMethodError):
    """`x-routing-method` is blank, not visible ASCII, or names no algorithm."""

    def __init__(self, requested: str) -> None:
        self.requested = requested
        super().__init__(f"unknown {h.ROUTING_METHOD} {detail(json.dumps(requested))}")


class UnavailableRoutingMethod(RoutingMethodError):
    """`x-routing-method` names an algorithm the configuration does not offer for the model."""

    def __init__(self, algorithm: Algorithm, model_id: str) -> None:
        self.algorithm = algorithm
        self.model_id = model_id
        super().__init__(
            f"{h.ROUTING_METHOD} {algorithm.value} is not configured for model {json.dumps(model_id)}"
        )


class RequestError(StargateError):
    """A request breaks the header/body contract; ``hint`` says how to make it work."""

    status = 400
    code = "invalid_request"
    kind = "invalid_request_error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.hint = hint
        super().__init__(message)

    def extra_fields(self) -> Mapping[str, object]:
        return {} if self.hint is None else {"hint": self.hint}


class PayloadTooLarge(RequestError):
    status = 413
    code = "payload_too_large"


class ExpectationFailed(RequestError):
    status = 417
    code = "expectation_failed"


class UnsupportedEncoding(RequestError):
    status = 415
    code = "unsupported_content_encoding"


class NoSuchEndpoint(StargateError):
    """A path this listener does not serve."""

    status = 404
    code = "not_found"
    kind = "invalid_request_error"


class MethodNotAllowed(StargateError):
    """A served path asked with another method (the ``Allow`` header lists the right ones)."""

    status = 405
    code = "method_not_allowed"
    kind = "invalid_request_error"


class ModelNotFound(StargateError):
    """``GET /v1/models/{id}`` for a model no active backend serves."""

    status = 404
    code = "model_not_found"
    kind = "not_found_error"


class RoutingError(StargateError):
    """No backend could be chosen for the request (registered but inactive, all clusters failed...).
    ``retry_after_ms``: every backend refused it and the soonest said to try again then; the client
    gets it as ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (the OpenAI SDKs
    read both)."""

    status = 503
    code = "no_selectable_backend"
    kind = "service_unavailable_error"

    def __init__(self, message: str = "", *, retry_after_ms: int | None = None) -> None:
        self.retry_after_ms = retry_after_ms
        super().__init__(message)

    def retry_headers(self) -> Mapping[str, str]:
        after = self.retry_after_ms
        if after is None:
            return {}
        return {"Retry-After": str(-(-after // 1000)), "retry-after-ms": str(after)}


class NoEligibleCandidates(RoutingError):
    status = 404
    code = "no_eligible_candidates"
    kind = "not_found_error"
    wire_code = True

    def __init__(self) -> None:
        super().__init__("no eligible candidates")


class InputWorkLimitExceeded(RoutingError):
    """Input-work admission refused the request; ``reason`` is the metric label (spec §3.9)."""

    code = "input_work_limit_exceeded"
    wire_code = True

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__("input work admission limit exceeded")


class BodyBufferFull(StargateError):
    """Request bodies held in memory are at the process's limit and none was freed in time."""

    status = 503
    code = "body_buffer_full"
    kind = "service_unavailable_error"


class HandlerTimedOut(StargateError):
    """A request handler let a timeout escape (aiohttp's 504)."""

    status = 504
    code = "timeout"


class UpstreamError(StargateError):
    """A backend could not be reached, or failed before answering."""

    status = 502
    code = "upstream_transport_error"


class UpstreamNotSent(UpstreamError):
    """The request never reached the backend (connection refused or failed): nothing executed."""


class UpstreamTimeout(UpstreamError):
    """No response headers within the request timeout: the backend may still be working on it."""


class UpstreamBroken(UpstreamError):
    """The backend answered, then its body broke before its first byte: the client has received
    nothing, but the backend may have run part of the request."""


class UpstreamInvalid(UpstreamError):
    """The backend answered with a response head that cannot be read: it ran the request, so it is
    not sent again (nginx's ``proxy_next_upstream`` leaves ``invalid_header`` out by default)."""


class BackendRejected(StargateError):
    """A refusal a backend answers before anything ran, with Stargate's retry headers."""

    status = 503
    kind = "service_unavailable_error"

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        self.retryable = retryable
        super().__init__(message)

    def retry_headers(self) -> Mapping[str, str]:
        return {
            h.RETRYABLE: "true" if self.retryable else "false",
            h.RETRY_REASON: self.code,
        }


class ModelNotAdmitted(BackendRejected):
    code = "model_generation_unavailable"

    def __init__(self) -> None:
        super().__init__("model generation is not admitted for request routing")


class QueueEstimateMismatch(BackendRejected):
    """Pylon's local queue is longer than Stargate expected (pylon.md §8.3)."""

    status = 429
    code = "queue_estimate_mismatch"
    kind = "rate_limit_error"

    def __init__(
        self,
        *,
        expected_ms: int | None,
        actual_ms: int | None,
        threshold_ms: int | None,
        retry_after_ms: int | None = None,
    ) -> None:
        self.fields = {
            "reason": self.code,
            "expected_queue_ms": expected_ms,
            "actual_queue_ms": actual_ms,
            "threshold_ms": threshold_ms,
        }
        self.retry_after_ms = retry_after_ms
        super().__init__("local queue estimate exceeded Stargate routing estimate")

    def retry_headers(self) -> Mapping[str, str]:
        headers = dict(super().retry_headers())
        if self.retry_after_ms is not None:
            headers[h.RETRY_AFTER_MS] = str(self.retry_after_ms)
        return headers

    def extra_fields(self) -> Mapping[str, object]:
        return self.fields


class EngineBodyBufferFull(BackendRejected):
    """Pylon's ``BodyBufferFull``: it read nothing of the body and sent nothing, so another
    backend may take the request."""

    code = BodyBufferFull.code

    def __init__(self, reason: BodyBufferFull) -> None:
        super().__init__(reason.message)


class RequestLoop(BackendRejected):
    """A request back at a router it already passed (a backend URL that leads to a router):
    refused before anything ran, so the router that sent it tries another backend."""

    code = "request_loop"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"request came back to a router it passed ({name} in Via): a backend's URL leads to a router"
        )


class LocalConnectFailure(BackendRejected):
    """Pylon's engine gave no answer: it could not be reached, so nothing ran (retryable unless
    configured off), or it read the request and then closed the connection, timed out or answered
    something that is not HTTP. The code is the wire contract for all of them; ``message`` says
    which happened, so an operator is not sent looking for a connection problem."""

    code = "local_connect_failure"

    def __init__(self, *, retryable: bool, message: str = "local upstream connection failed") -> None:
        super().__init__(message, retryable=retryable)


class FaultError(RequestError):
    """A mock engine test-control body field is invalid; the message names it (answered as plain text)."""

    code = "invalid_fault"


class RegistrationRejected(StargateError):
    """A registration message breaks the contract (§5.4); the stream ends with INVALID_ARGUMENT."""

    status = 400
    code = "invalid_registration"
    kind = "invalid_request_error"


class StartupError(StargateError):
    """Pylon could not become ready; nothing was registered."""


class CalibrationError(StartupError):
    """Calibration could not produce a usable input throughput."""


class DiscoveryError(StargateError):
    """One model discovery poll failed."""


class DiscoveryFailed(DiscoveryError):
    """Stargate's peer DNS lookup failed; the caller publishes itself only."""


class ProcessError(StargateError):
    """A child process failed to start, exited early or never printed its ready line."""


class PeerInstallError(StargateError):
    """A peer router could not be installed (no network, no such version, pip failed)."""
