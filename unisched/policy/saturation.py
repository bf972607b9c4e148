"""When to slice at all: only while a resource is saturated.

Why: demand (CPU activity, an open session) says a tenant has work, not that tenants contend. Paced and pipelined
loads (cloud-gaming instances at 60 FPS, a render -> decode -> inference pipeline, online inference at 20 req/s)
each show demand in most slices while together they use a fraction of the GPU; slicing them in turn cost them
3/4 and more of their throughput on the H200 (bench/results/2026-11-30-h200-scenarios/). So the kernel engine
lets every tenant of a resource run (the resource is "open") until the resource is busy, and slices by weight
while it is saturated.

The state machine, per resource, fed one utilization sample per slice:
  open    -> sliced  when the mean of the last `enter_slices` slices is >= `high` with two or more tenants wanting
                     it all along (a mean, not every slice: a short window's busy fraction is noisy, and one slice
                     below the line must not restart the count for a pair that is never idle on average);
  sliced  -> open    after `leave_slices` slices in a row at < `low` with two or more wanting it (the holders leave
                     the GPU idle while others wait), or as soon as fewer than two want it.
A resource that re-saturates soon after opening (paced tenants that together overload it) waits twice as long
before the next re-opening (up to `max_leave_slices`), so it settles into slicing instead of flapping each slice.
Pure: no clock, no I/O; the caller passes the samples in slice order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unisched.policy.model import PolicyError, Resource

__all__ = ["SaturationConfig", "SaturationGate"]


@dataclass(frozen=True)
class SaturationConfig:
    high: float = 0.90  # utilization that counts as saturated; 0 disables the gate (always slice)
    low: float = 0.60  # holders below this while others wait: open again
    enter_slices: int = 2
    leave_slices: int = 2
    max_leave_slices: int = 64
    flap_slices: int = 8  # re-saturating within this many slices of opening doubles the wait before re-opening

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise PolicyError(f"saturation thresholds must satisfy 0 <= low ({self.low}) <= high ({self.high}) <= 1")
        if min(self.enter_slices, self.leave_slices, self.flap_slices) < 1 or self.max_leave_slices < self.leave_slices:
            raise PolicyError("saturation slice counts must be >= 1 and max_leave_slices >= leave_slices")

    @property
    def enabled(self) -> bool:
        return self.high > 0.0


@dataclass
class _State:
    sliced: bool = False
    run: int = 0  # consecutive slices meeting the condition to switch
    leave_after: int = 0  # slices below `low` needed to open again (doubles on flapping)
    opened_for: int = 0  # slices since the resource last opened
    recent: list[float] = field(default_factory=list)  # the last enter_slices samples while open and contended


@dataclass
class SaturationGate:
    """Per-resource open/sliced state; `open(r)` says whether every tenant of r may run regardless of the slice."""

    config: SaturationConfig = field(default_factory=SaturationConfig)
    _states: dict[Resource, _State] = field(default_factory=dict)

    def observe(self, resource: Resource, util: float | None, contenders: int) -> bool:
        """One slice's busy fraction of `resource` (None: no GPU signal) and how many tenants want it.

        Returns whether the resource is open for the next slice. Without a signal nothing is known about
        saturation, so the resource is sliced (the engine's behaviour before this gate).
        """
        c = self.config
        # a first saturation is not a flap: only a re-opening that saturates again soon is
        s = self._states.setdefault(resource, _State(leave_after=c.leave_slices, opened_for=c.flap_slices + 1))
        if not c.enabled or util is None:
            s.sliced, s.run = True, 0
            return False
        if contenders < 2:  # nobody to share with: nothing to slice
            if s.sliced:
                s.sliced, s.run, s.opened_for = False, 0, 0
            s.opened_for += 1
            s.recent.clear()
            return True
        if not s.sliced:
            s.opened_for += 1
            s.recent.append(util)
            del s.recent[:-c.enter_slices]
            if len(s.recent) == c.enter_slices and sum(s.recent) >= c.high * c.enter_slices - 1e-9:
                s.recent.clear()
                if s.opened_for <= c.flap_slices:
                    s.leave_after = min(2 * s.leave_after, c.max_leave_slices)
                else:
                    s.leave_after = c.leave_slices
                s.sliced, s.run = True, 0
        else:
            s.run = s.run + 1 if util < c.low else 0
            if s.run >= s.leave_after:
                s.recent.clear()
                s.sliced, s.run, s.opened_for = False, 0, 0
        return not s.sliced

    def is_open(self, resource: Resource) -> bool:
        s = self._states.get(resource)
        return s is not None and not s.sliced

    def forget(self, resource: Resource) -> None:
        self._states.pop(resource, None)
