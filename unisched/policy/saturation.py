"""When to slice at all: only while a resource is saturated.

Why: demand (CPU activity, an open session) says a tenant has work, not that tenants contend. Paced and pipelined
loads (cloud-gaming instances at 60 FPS, a render -> decode -> inference pipeline, online inference at 20 req/s)
each show demand in most slices while together they use a fraction of the GPU; sliced in turn, each runs only in
its turn and loses most of its throughput (3/4 and more of it, for such loads on an H200). So freezer enforcement
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
(its turns are used: a greedy tenant is there, slice it). A hold that ends while its tenants are rationed is renewed
instead (`gate_step`'s `rationed`).
"used" is the caller's judgement; policy.plan.turn_used counts a turn used when the GPU was busy or a compute
holder kept a CPU busy (CUDA work that utilization does not show, such as PyTorch's on the H200 VM, still keeps its launching
thread busy).
Pure: no clock, no I/O; the caller passes the samples in slice order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from unisched.policy.model import PolicyError, Resource

__all__ = ["GateMemory", "GateState", "SaturationConfig", "SaturationGate", "fresh_gate", "gate_states", "gate_step",
           "rationing"]


@dataclass(frozen=True)
class SaturationConfig:
    """The gate's numbers. No defaults here: the daemon's come from its knobs and policy.tuning (Tuning.gate)."""

    high: float
    """Mean busy fraction that counts as saturated; 0 disables the gate (always slice)."""
    low: float
    """A slice busier than this used its turn."""
    enter_slices: int
    leave_slices: int
    hold_slices: int
    """Held open this long after slicing was found to leave turns unused (doubling)."""
    max_hold_slices: int
    reset_slices: int
    """A sliced stretch this long with used turns resets the hold."""
    cap_settle_slices: int
    """While rationing, the cap on how many sit out is lowered at most once in this many slices: one of NVML's
    samples spans several slices, and a reading seen at each must not lower it at each (policy.rationing)."""
    cap_release_slices: int
    """While rationing, a cap not lowered for this many slices rises by one; 0: it lasts while the resource is held
    open."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise PolicyError(f"saturation thresholds must satisfy 0 <= low ({self.low}) <= high ({self.high}) <= 1")
        if min(self.enter_slices, self.leave_slices, self.reset_slices) < 1 or self.hold_slices < 0 \
                or self.max_hold_slices < self.hold_slices:
            raise PolicyError("saturation slice counts must be >= 1, hold_slices >= 0 and max_hold_slices >= hold_slices")
        if self.cap_settle_slices < 1 or self.cap_release_slices < 0:
            raise PolicyError("cap_settle_slices must be >= 1 and cap_release_slices >= 0")

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


@dataclass(frozen=True)
class GateMemory:
    """One resource's gate between slices (a value: `gate_step` returns the next one)."""

    sliced: bool = False
    run: int = 0
    """Consecutive sliced slices whose turns went unused."""
    sliced_for: int = 0
    """Slices since slicing began."""
    hold: int = 0
    """Slices left to stay open whatever the busy fraction."""
    next_hold: int = 0
    """The hold after the next slicing that leaves turns unused."""
    recent: tuple[float, ...] = ()
    """The last enter_slices samples while open and contended."""

    @property
    def open(self) -> bool:
        return not self.sliced

    @property
    def held(self) -> int:
        """Slices it stays open whatever its busy fraction (after slicing left turns unused)."""
        return 0 if self.sliced else self.hold


def rationing(c: SaturationConfig, s: GateMemory, was: bool = False) -> bool:
    """Held open after slicing left the turns unused, and still saturated (the mean busy fraction of the last
    `enter_slices` open slices >= `high`; once rationing, >= `low`, since those sitting out leave it a little room at
    times): paced tenants that fill the GPU only together. Every tenant may run, but those furthest ahead of their
    weight share sit out (policy.rationing), so the weights hold without turns that one tenant cannot fill.
    Not where the GPU reads idle: nobody is held back from idle time."""
    if not c.enabled or s.sliced or s.hold <= 0 or len(s.recent) < c.enter_slices:
        return False
    return sum(s.recent) >= (c.low if was else c.high) * c.enter_slices - 1e-9


def fresh_gate(config: SaturationConfig) -> GateMemory:
    """A resource the gate has not seen yet (open, with the first hold ready)."""
    return GateMemory(next_hold=config.hold_slices)


def gate_step(c: SaturationConfig, s: GateMemory, util: float | None, contenders: int,
              used: bool | None = None, rationed: bool = False) -> GateMemory:
    """The state machine of the module docstring: one slice's busy fraction (None: no GPU signal), how many
    tenants want the resource, and whether the tenants that ran used the slice (None: judged by the busy fraction
    alone). Without a signal nothing is known about saturation, so the resource is sliced.
    `rationed`: the resource was rationed in this slice (`rationing`). A hold that ends so is renewed (doubling,
    as after unused turns) rather than tried again: the try freezes every tenant for the others' turns, which paced
    tenants feel as a stall of 0.4 s and more every time, and rationing keeps the weights meanwhile. A tenant that
    turns greedy is rationed too (it sits out while ahead) rather than given turns; rationing ends, and the hold with
    it, once the resource has room."""
    if not c.enabled or util is None:
        return replace(s, sliced=True, run=0)
    if contenders < 2:  # nobody to share with: nothing to slice, and a new set of contenders starts afresh
        return replace(s, sliced=False, run=0, hold=0, next_hold=c.hold_slices, recent=())
    if not s.sliced:
        recent = (*s.recent, util)[-c.enter_slices:]
        if s.hold == 1 and rationed and s.next_hold:
            return replace(s, recent=recent, hold=s.next_hold, next_hold=min(2 * s.next_hold, c.max_hold_slices))
        if s.hold > 0:
            return replace(s, recent=recent, hold=s.hold - 1)
        if len(recent) == c.enter_slices and sum(recent) >= c.high * c.enter_slices - 1e-9:
            return replace(s, recent=(), sliced=True, run=0, sliced_for=0)
        return replace(s, recent=recent)
    sliced_for = s.sliced_for + 1
    next_hold = s.next_hold
    if sliced_for >= c.reset_slices and s.run == 0:
        next_hold = c.hold_slices  # the turns are being used: slicing is doing its job
    turn_used = util >= c.low if used is None else used
    run = 0 if turn_used else s.run + 1
    if run >= c.leave_slices:
        return replace(s, sliced=False, run=0, sliced_for=sliced_for, hold=next_hold, recent=(),
                       next_hold=min(2 * next_hold, c.max_hold_slices) if next_hold else c.hold_slices)
    return replace(s, run=run, sliced_for=sliced_for, next_hold=next_hold)


@dataclass
class SaturationGate:
    """Per-resource open/sliced state; `open(r)` says whether every tenant of r may run regardless of the slice.
    A mutable holder of `GateMemory` values around `gate_step`."""

    config: SaturationConfig
    _states: dict[Resource, GateMemory] = field(default_factory=dict)

    def observe(self, resource: Resource, util: float | None, contenders: int, used: bool | None = None) -> bool:
        """One slice's busy fraction of `resource` (None: no GPU signal), how many tenants want it, and whether
        the tenants that ran used the slice (None: judged by the busy fraction alone).

        Returns whether the resource is open for the next slice (see `gate_step`).
        """
        s = self._states.get(resource) or fresh_gate(self.config)
        s = self._states[resource] = gate_step(self.config, s, util, contenders, used)
        return s.open

    def held(self, resource: Resource) -> int:
        """Slices the resource stays open whatever its busy fraction (after slicing left turns unused)."""
        s = self._states.get(resource)
        return 0 if s is None else s.held

    def states(self) -> tuple[GateState, ...]:
        return gate_states(self._states)

    def is_open(self, resource: Resource) -> bool:
        s = self._states.get(resource)
        return s is not None and s.open

    def forget(self, resource: Resource) -> None:
        self._states.pop(resource, None)


def gate_states(memory: Mapping[Resource, GateMemory]) -> tuple[GateState, ...]:
    """What metrics show per resource: sliced or open, and the hold left."""
    return tuple(GateState(r, s.sliced, s.held) for r, s in memory.items())
