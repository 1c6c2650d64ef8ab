"""Pure rules of the registration stream: authentication input, admission, identity, idle timeout.

Direct mode accepts ``http``/``https`` URLs with any host (the original demanded ``quic://`` with
an IP host; see docs/compat.md). Messages are the original's, in the original's order (§5.4).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from stargate.balancer.types import ModelStats
from stargate.errors import RegistrationRejected
from stargate.proto import stargate_pb2
from stargate.wire import headers as h
from stargate.wire.limits import U64_MAX
from stargate.wire.proto import stats_from_proto as convert_stats

_DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 2048
_ACTIVE = stargate_pb2.INFERENCE_SERVER_STATUS_ACTIVE


@dataclass(frozen=True, slots=True)
class Identity:
    """What later messages of an admitted stream must repeat (§5.4)."""

    inference_server_id: str
    inference_server_url: str
    reverse_tunnel: bool
    cluster_id: str


class WorkerAuthenticator(Protocol):
    """Turns a worker's bearer token into its routing key; raising any error means rejection."""

    async def authenticate(self, token: str | None) -> str | None: ...


class OpenAuthenticator:
    """Accepts every worker, without a routing key (the default, §5.9)."""

    async def authenticate(self, token: str | None) -> str | None:
        return None


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of ``authorization: Bearer <token>`` (exact prefix), else ``None``."""
    for key, value in metadata:
        if key.lower() == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


def metadata_value(metadata: Iterable[tuple[str, str | bytes]], name: str) -> str | bytes | None:
    for key, value in metadata:
        if key.lower() == name:
            return value
    return None


def idle_timeout_ms(heartbeat: str | bytes | None, floor_ms: int, cap_ms: int) -> int | None:
    """Negotiated idle timeout (§5.6); ``None`` means no timeout."""
    if floor_ms == 0 or cap_ms == 0:
        return None
    beat = h.optional_unsigned(heartbeat, U64_MAX) if isinstance(heartbeat, str) else None
    if beat is None:
        return cap_ms
    return min(max(min(3 * beat, U64_MAX), floor_ms), cap_ms)


def _url_error(detail: str) -> RegistrationRejected:
    return RegistrationRejected(f"invalid inference_server_url: inference_server_url {detail}")


def validate_url(url: str) -> tuple[str, int]:
    """The URL's host and effective port; checks parse, then scheme, then host, as the original.

    Both accepted schemes have a default port, so the original's ``must include port`` cannot occur.
    """
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise _url_error("must be a valid URL")
    try:
        parts = urlsplit(url)
        explicit_port = parts.port  # raises on a malformed or out-of-range port
    except ValueError as exc:
        raise _url_error("must be a valid URL") from exc
    scheme = parts.scheme.lower()
    if not scheme:
        raise _url_error("must be a valid URL")
    if scheme not in _DEFAULT_PORTS:
        raise _url_error("scheme must be http or https")
    if not parts.hostname:
        raise _url_error("must include host")
    return parts.hostname, explicit_port if explicit_port is not None else _DEFAULT_PORTS[scheme]


def admit_first(message: stargate_pb2.InferenceServerRegistration, *, reverse_listener: bool) -> Identity:
    """Admission validation of the first message (§5.4); raises ``RegistrationRejected``."""
    if not message.inference_server_id:
        raise RegistrationRejected("inference_server_id is empty")
    if not message.inference_server_url:
        raise RegistrationRejected("inference_server_url is empty")
    validate_url(message.inference_server_url)
    if message.reverse_tunnel and not reverse_listener:
        raise RegistrationRejected("reverse tunnel flag set but no reverse tunnel config")
    # Stargate sets these on every response it proxies for this backend; a value no header can hold
    # would turn each of those requests into a 500 (docs/compat.md), so it is refused here instead.
    for name, value, limit in (("inference_server_id", message.inference_server_id, h.MAX_ID_CHARS),
                               ("inference_server_url", message.inference_server_url, MAX_URL_CHARS),
                               ("cluster_id", message.cluster_id, h.MAX_ID_CHARS)):  # fmt: skip
        problem = h.identity_problem(name, value, limit)
        if problem is not None:
            raise RegistrationRejected(problem)
    return Identity(
        inference_server_id=message.inference_server_id,
        inference_server_url=message.inference_server_url,
        reverse_tunnel=message.reverse_tunnel,
        cluster_id=message.cluster_id or message.inference_server_id,
    )


def check_identity(identity: Identity, message: stargate_pb2.InferenceServerRegistration) -> None:
    if message.reverse_tunnel != identity.reverse_tunnel:
        raise RegistrationRejected("reverse tunnel flag changed")
    if message.inference_server_url != identity.inference_server_url:
        raise RegistrationRejected("inference_server_url changed")
    if message.inference_server_id != identity.inference_server_id:
        raise RegistrationRejected("inference_server_id changed")
    if (message.cluster_id or message.inference_server_id) != identity.cluster_id:
        raise RegistrationRejected("cluster_id changed")


def model_updates(
    message: stargate_pb2.InferenceServerRegistration, *, max_models: int
) -> Mapping[str, ModelStats | None]:
    """Every listed model mapped to its stats when effectively ACTIVE (§1.6), else ``None``.

    An entry without ``stats`` is inactive whatever its status; unknown status values are not ACTIVE.
    """
    if len(message.models) > max_models:
        count = len(message.models)
        raise RegistrationRejected(f"too many models in one registration: {count} (limit {max_models})")
    updates: dict[str, ModelStats | None] = {}
    for model_id, entry in message.models.items():
        _check_model_id(model_id)
        if entry.status == _ACTIVE and entry.HasField("stats"):
            updates[model_id] = convert_stats(entry.stats)
        else:
            updates[model_id] = None
    return updates


def _check_model_id(model_id: str) -> None:
    """Refuses a model id no request can name or too long for a label: each update made it a metrics
    label and a ``/v1/models`` entry, and one new 256 KB id in each of 300 updates grew a scrape to
    77 MB."""
    problem = h.model_id_problem(model_id)
    if problem is not None:
        raise RegistrationRejected(problem)
