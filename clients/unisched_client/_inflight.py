"""Timing GPU work with events, shared by the CUDA (pycuda), PyTorch and GL helpers.

Each unit is bracketed by a start and an end marker; their elapsed GPU time is read once the end has
completed, without waiting, so the app's pipeline stays full. At most `max_in_flight` units are
outstanding (the oldest is waited for beyond that), and one while others wait for the engine (the lease is
contended): the next unit is still queued behind the running one, but a hand-over leaves only that one to
run beside the next holder's work, where the driver time-slices the two. A unit that ends after the lease was
revoked drains the rest (`add`); an app already waiting for the next lease does not (see `Gate`).

While contended, the gate also takes a unit queued behind a running one to start when that one is expected to end
(`Gate.busy_until`, from the measured lengths): a unit that would start past the slice's end waits for the daemon's
next decision, which comes before the running one ends. A revoke then leaves one unit, not two, beside the next holder.

Pause points (`split`) end a part of a unit inside it, while others wait for the engine: the part is timed and
charged like a unit, and the rest starts only as a unit would (the lease held, the slice not over). Why: an app gated
once per step leaves the rest of a revoked step to run beside the next holder (a ResNet-50 b32 step is ~25 ms; an
online request ~6 ms, which then shares the GPU for all of its time); split, at most a part or two is left.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from unisched_client.gate import Gate

__all__ = ["InFlight"]

M = TypeVar("M")

POLL_S = 0.001
"""While the app waits for the engine with units still running (`InFlight.acquire`), how often it looks whether they
ended, once their expected end has passed: at least this, and a tenth of how late they are (a unit the GPU never ends
costs a few looks a second, not a thousand)."""

MEAN_WEIGHT = 0.5
"""How much each measured unit moves `InFlight.mean_s`: about two units' memory, so a step that ran time-sliced
beside another tenant does not set the estimate alone."""


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
        self.units: deque[tuple[M, int]] = deque()
        """Outstanding units or parts, each with how many units it completes (0 for a part, 1 for a unit's end)."""
        self.splits = 0
        self.mean_s: float | None = None
        """The measured length of a unit or part (moving mean): how long a queued one keeps the GPU busy."""
        self._first_acquired_at = 0.0
        """When the oldest outstanding unit was let start (Gate.acquired_at): it started on the GPU no earlier."""

    def collect(self) -> None:
        """Report every finished unit (oldest first; stop at the first that is still running)."""
        while self.units and self._done(self.units[0][0]):
            self._report(self.units.popleft())
        if not self.units:
            self._expect(0.0)

    def acquire(self) -> None:
        """Wait until the next unit may start (`Gate.acquire`), reporting the units still running as they end. Why:
        a revoked holder's unit in flight runs on beside the next holder while the app waits here; seen done only when
        the next grant lets the app go on, it would be reported a turn late, as if it ran then, and the daemon would
        take it off the busy time it charges an unmodified app in that turn (a few points of the GPU at 50 ms steps)."""
        self.collect()
        clock = self.gate.client.clock
        while self.units:
            now = clock.monotonic()
            expected = self.gate.busy_until or self._first_acquired_at or now
            if self.gate.acquire(timeout=max(POLL_S, expected - now, (now - expected) / 10)):
                return
            self.collect()
        self.gate.acquire()

    def add(self, unit: M, whole: bool = True) -> None:
        if not self.units:
            self._first_acquired_at = self.gate.acquired_at
        self.units.append((unit, 1 if whole else 0))
        limit = 1 if self.gate.contended and self.gate.client.governed else self.max_in_flight
        freed = 0.0
        while len(self.units) > limit:
            self._finish_oldest()
            freed = self.gate.client.clock.monotonic()  # the next one starts on the GPU as this one ends
        self.collect()
        if self.units:
            start = max(freed, self._first_acquired_at)
            self._expect(start + len(self.units) * self.mean_s if self.mean_s is not None else 0.0)
        if self.gate.ending():
            self.drain()

    def split_wanted(self) -> bool:
        """Whether a pause point should end a part here: only while others wait for the engine (or it was
        revoked), so a tenant alone pays nothing for its points."""
        g = self.gate
        with g.client._cond:
            return g.client.governed and (g.contended or not g.lease)

    def split(self, part: M) -> None:
        """End the part of the current unit queued since its start (or the last split), then wait to go on as a
        unit would start: until the lease is held and, when contended, the slice not over. The caller starts
        timing the next part after this returns."""
        self.splits += 1
        self.add(part, whole=False)
        self.acquire()

    def drain(self) -> None:
        while self.units:
            self._finish_oldest()
        self._expect(0.0)

    def _finish_oldest(self) -> None:
        self._wait(self.units[0][0])
        self._report(self.units.popleft())
        self._first_acquired_at = 0.0  # the next one started when this one ended: add() knows when that was

    def _report(self, entry: tuple[M, int]) -> None:
        unit, units = entry
        elapsed = self._elapsed(unit)
        self.mean_s = elapsed if self.mean_s is None else self.mean_s + MEAN_WEIGHT * (elapsed - self.mean_s)
        self.gate.done(elapsed, units)

    def _expect(self, busy_until: float) -> None:
        with self.gate.client._cond:
            self.gate.busy_until = busy_until
