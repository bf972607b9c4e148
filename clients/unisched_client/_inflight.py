"""Timing GPU work with events, shared by the CUDA (pycuda), PyTorch and GL helpers.

Each unit is bracketed by a start and an end marker; their elapsed GPU time is read once the end has
completed, without waiting, so the app's pipeline stays full. At most `max_in_flight` units are
outstanding (the oldest is waited for beyond that), and one while others wait for the engine (the lease is
contended): the next unit is still queued behind the running one, but a hand-over leaves only that one to
run beside the next holder's work, where the driver time-slices the two. A unit that ends after the lease was
revoked drains the rest (`add`); an app already waiting for the next lease does not (see `Gate`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from unisched_client.client import Gate

__all__ = ["InFlight"]

M = TypeVar("M")


class InFlight(Generic[M]):
    def __init__(
        self,
        gate: Gate,
        done: Callable[[M], bool],
        wait: Callable[[M], None],
        elapsed_s: Callable[[M], float],
        max_in_flight: int = 2,
    ) -> None:
        self.gate = gate
        self._done = done
        self._wait = wait
        self._elapsed = elapsed_s
        self.max_in_flight = max(1, max_in_flight)
        self.units: deque[M] = deque()

    def collect(self) -> None:
        """Report every finished unit (oldest first; stop at the first that is still running)."""
        while self.units and self._done(self.units[0]):
            self.gate.done(self._elapsed(self.units.popleft()))

    def add(self, unit: M) -> None:
        self.units.append(unit)
        limit = 1 if self.gate.contended and self.gate.client.governed else self.max_in_flight
        while len(self.units) > limit:
            self._finish_oldest()
        self.collect()
        if self.gate.ending():
            self.drain()

    def drain(self) -> None:
        while self.units:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        self._wait(self.units[0])
        self.gate.done(self._elapsed(self.units.popleft()))
