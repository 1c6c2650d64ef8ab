"""The Stargate router service: routing state, gRPC control plane, HTTP proxy, metrics and CLI."""

from __future__ import annotations

from stargate.router.clusters import Backend, Reservation
from stargate.router.state import RegistrationHandle, RoutingState, TargetView

__all__ = ["Backend", "RegistrationHandle", "Reservation", "RoutingState", "TargetView"]
