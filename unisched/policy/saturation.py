"""When to slice at all: only while a resource is saturated.

Why: demand (CPU activity, an open session) says a tenant has work, not that tenants contend. Paced and pipelined
loads (cloud-gaming instances at 60 FPS, a render -> decode -> inference pipeline, online inference at 20 req/s)
each show demand in most slices while together they use a fraction of the GPU; slicing them in turn cost them
3/4 and more of their throughput on the H200 (bench/results/2026-11-30-h200-scenarios/). So the kernel engine
lets every tenant of a resource run (the resource is "open") until the resource is busy, and slices by weight
while it is saturated.

The state machine, per resource, fed one sample per slice (the busy fraction, and whether the tenants running in
the slice used it):
  open    -> sliced  when the mean busy fraction of the last `enter_slices` slices is >= `high` with two or more
                     tenants wanting it (a mean, not every slice: a short window's busy fraction is noisy), unless
                     it is being held open (below);
  sliced  -> open    after `leave_slices` slices in a row whose holders did not use their turn (the GPU under `low`,
                     unless the caller says otherwise), or as soon as fewer than two want it.
Slicing that leaves the turns unused is what paced tenants do (sixteen cloud-gaming instances keeping 60 FPS
between them read 94-100% busy on the H200, yet each uses a few ms of its 50 ms turn): it costs them most of their
frames and gives nobody anything. So a resource opened for unused turns is held open for `hold_slices`, doubling
each time it happens again (up to `max_hold_slices`), and back to `hold_slices` once slicing lasts `reset_slices`
(its turns are used: a greedy tenant is there, slice it).
"used" is the caller's judgement; the engine counts a turn used when the GPU was busy or a compute holder kept a
CPU busy (CUDA work that utilization does not show, such as PyTorch's on the H200 VM, still keeps its launching
thread busy).
Pure: no clock, no I/O; the caller passes the samples in slice order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from unisched.policy.model import PolicyError, Resource

__all__ = ["GateState", "SaturationConfig", "SaturationGate"]


@dataclass(frozen=True)
class SaturationConfig:
    high: float = 0.90  # mean busy fraction that counts as saturated; 0 disables the gate (always slice)
    low: float = 0.60  # a slice busier than this used its turn
    enter_slices: int = 2
    leave_slices: int = 2
    hold_slices: int = 40  # held open this long after slicing was found to leave turns unused (doubling)
    max_hold_slices: int = 600
    reset_slices: int = 40  # a sliced stretch this long with used turns resets the hold

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise PolicyError(f"saturation thresholds must satisfy 0 <= low ({self.low}) <= high ({self.high}) <= 1")
        if min(self.enter_slices, self.leave_slices, self.reset_slices) < 1 or self.hold_slices < 0 \
                or self.max_hold_slices < self.hold_slices:
            raise PolicyError("saturation slice counts must be >= 1, hold_slices >= 0 and max_hold_slices >= hold_slices")

    @property
    def enabled(self) -> bool:
        return self.high > 0.0


@dataclass(frozen=True)
class GateState:
    """What the gate decided for one resource: whether its tenants take turns, and for how many more slices it
    stays open whatever its busy fraction (after slicing left turns unused)."""

    resource: Resource
    sliced: bool
    held_slices: int


@dataclass
class _State:
    sliced: bool = False
    run: int = 0  # consecutive sliced slices whose turns went unused
    sliced_for: int = 0  # slices since slicing began
    hold: int = 0  # slices left to stay open whatever the busy fraction
    next_hold: int = 0  # the hold after the next slicing that leaves turns unused
    recent: list[float] = field(default_factory=list)  # the last enter_slices samples while open and contended


@dataclass
class SaturationGate:
    """Per-resource open/sliced state; `open(r)` says whether every tenant of r may run regardless of the slice."""

    config: SaturationConfig = field(default_factory=SaturationConfig)
    _states: dict[Resource, _State] = field(default_factory=dict)

    def observe(self, resource: Resource, util: float | None, contenders: int, used: bool | None = None) -> bool:
        """One slice's busy fraction of `resource` (None: no GPU signal), how many tenants want it, and whether
        the tenants that ran used the slice (None: judged by the busy fraction alone).

        Returns whether the resource is open for the next slice. Without a signal nothing is known about
        saturation, so the resource is sliced (the engine's behaviour before this gate).
        """
        c = self.config
        s = self._states.setdefault(resource, _State(next_hold=c.hold_slices))
        if not c.enabled or util is None:
            s.sliced, s.run = True, 0
            return False
        if contenders < 2:  # nobody to share with: nothing to slice, and a new set of contenders starts afresh
            s.sliced, s.run, s.hold, s.next_hold = False, 0, 0, c.hold_slices
            s.recent.clear()
            return True
        if not s.sliced:
            s.recent.append(util)
            del s.recent[:-c.enter_slices]
            if s.hold > 0:
                s.hold -= 1
            elif len(s.recent) == c.enter_slices and sum(s.recent) >= c.high * c.enter_slices - 1e-9:
                s.recent.clear()
                s.sliced, s.run, s.sliced_for = True, 0, 0
            return not s.sliced
        s.sliced_for += 1
        if s.sliced_for >= c.reset_slices and s.run == 0:
            s.next_hold = c.hold_slices  # the turns are being used: slicing is doing its job
        turn_used = util >= c.low if used is None else used
        s.run = 0 if turn_used else s.run + 1
        if s.run >= c.leave_slices:
            s.sliced, s.run, s.hold = False, 0, s.next_hold
            s.next_hold = min(2 * s.next_hold, c.max_hold_slices) if s.next_hold else c.hold_slices
            s.recent.clear()
        return not s.sliced

    def held(self, resource: Resource) -> int:
        """Slices the resource stays open whatever its busy fraction (after slicing left turns unused)."""
        s = self._states.get(resource)
        return 0 if s is None or s.sliced else s.hold

    def states(self) -> tuple[GateState, ...]:
        return tuple(GateState(r, s.sliced, 0 if s.sliced else s.hold) for r, s in self._states.items())

    def is_open(self, resource: Resource) -> bool:
        s = self._states.get(resource)
        return s is not None and not s.sliced

    def forget(self, resource: Resource) -> None:
        self._states.pop(resource, None)
