"""Leases, lease enforcement's mechanism: the engine tells a cooperative client it may (or may no longer) use
an engine of the GPU. One small Protocol, `LeaseChannel` (the gRPC stream implements it in the transport),
and `FakeLeaseChannel` beside it for engine logic tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from unisched.policy import Engine

__all__ = ["FakeLeaseChannel", "LeaseChannel", "LeaseGrant", "LeaseMessage", "LeaseRevoke"]


@dataclass(frozen=True)
class LeaseGrant:
    """You hold `engine` until revoked; renew within `valid_s`. Sent on a new lease and at every decision
    while it lasts (same `lease` id), so the holder learns how long the slice is."""

    lease: int
    engine: Engine
    valid_s: float
    contended: bool
    """Others wait for the engine: stop submitting by `slice_left_s` so the hand-over is clean."""
    slice_left_s: float
    jump: bool = False
    """Preemptive mode, an online tenant with no other online tenant: its wants are granted at once, so after a
    release it may start its next unit as it asks: the want's round trip (~1 ms at p50, several at p99 on a busy
    host) would otherwise be most of an online request's added latency under lease enforcement)."""


@dataclass(frozen=True)
class LeaseRevoke:
    lease: int
    engine: Engine
    reason: str


LeaseMessage = LeaseGrant | LeaseRevoke


class LeaseChannel(Protocol):
    def send(self, message: LeaseMessage) -> None:
        """Queue a message for the client; never blocks (the engine runs in the event loop)."""
        ...


class FakeLeaseChannel:
    def __init__(self) -> None:
        self.messages: list[LeaseMessage] = []

    def send(self, message: LeaseMessage) -> None:
        self.messages.append(message)

    def take(self) -> list[LeaseMessage]:
        out, self.messages = self.messages, []
        return out
