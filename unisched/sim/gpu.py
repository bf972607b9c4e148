"""A simulated GPU contention domain: the queued work of several tenants sharing one engine.

Streams that have work queued share the domain by processor sharing: with k of them busy, each runs at e/k
(the driver time-slices contexts; measured on the H200: two CUDA processes 46/46, so e = 0.92 for them; two
render 50/50, e = 1). Each is charged its 1/k of the wall time, as a GPU timer around its work would see it.
Nothing here knows about freezing: a stream whose `submitting` is False submits nothing new, and whatever it
has queued runs to the end, which is exactly the drain a real GPU shows after a cgroup freeze.
"""

from __future__ import annotations

from unisched.policy import Resource
from unisched.sim.workload import StreamSpec

__all__ = ["SimResource", "SimStream"]

_EPS_S = 1e-12
"""Items with less than this left are done (the remainder of float subtraction)."""


class SimStream:
    """One queue of equal work items of one tenant on one engine."""

    __slots__ = ("done", "head_left", "item_s", "owner", "queued", "resource", "slice_used", "spec", "submitting", "used")

    def __init__(self, owner: str, spec: StreamSpec, resource: SimResource) -> None:
        self.owner = owner
        self.spec = spec
        self.item_s = spec.item_s
        self.resource = resource
        self.queued = 0
        """Items queued, the one running included."""
        self.head_left = 0.0
        """GPU time the running item still needs."""
        self.submitting = False
        """Whether the tenant can submit now (thawed and has work): it then keeps `depth` items queued."""
        self.used = 0.0
        self.slice_used = 0.0
        self.done = 0

    def fill(self) -> None:
        """Queue up to `depth` items (a stream that had none joins its domain's busy streams)."""
        if self.queued == 0:
            self.head_left = self.item_s
            self.resource.busy.append(self)
        self.queued = self.spec.depth


class SimResource:
    """One contention domain of one GPU (e.g. the SMs of GPU 0), advanced in time by `advance`."""

    __slots__ = ("busy", "busy_s", "clock", "contended_s", "efficiency", "emptied", "resource", "wanted_s", "wanting")

    def __init__(self, resource: Resource, efficiency: float = 1.0) -> None:
        self.resource = resource
        self.efficiency = efficiency
        """Work done per second of wall time while two or more streams time-slice the domain."""
        self.busy: list[SimStream] = []
        """Streams with work queued."""
        self.emptied: list[SimStream] = []
        """Streams that ran out of work since the owner last cleared this (they ran, and are no longer busy)."""
        self.clock = 0.0
        self.busy_s = 0.0
        """Time with any work running."""
        self.wanting = 0
        """Tenants with work for this domain now (running or frozen): idle time while > 0 is lost time."""
        self.contended_s = 0.0
        """Time that two or more tenants had work here."""
        self.wanted_s = 0.0
        """Time that some tenant had work here (efficiency = busy_s / wanted_s)."""

    def advance(self, until: float) -> None:
        """Run the queued work from `clock` to `until` (no freeze, thaw or activity change in between)."""
        t = self.clock
        if until <= t:
            return
        busy = self.busy
        start = t
        while busy:
            k = len(busy)
            rate = (1.0 if k == 1 else self.efficiency) / k
            step = min(s.head_left for s in busy)
            wall = step / rate
            if t + wall >= until:
                progress, share = (until - t) * rate, (until - t) / k
                for s in busy:
                    s.head_left -= progress
                    s.used += share
                    s.slice_used += share
                t = until
                break
            share = wall / k
            for s in busy:
                s.head_left -= step
                s.used += share
                s.slice_used += share
            t += wall
            emptied = False
            for s in busy:
                if s.head_left <= _EPS_S:
                    s.done += 1
                    if s.submitting:
                        s.queued = s.spec.depth
                    else:
                        s.queued -= 1
                    if s.queued > 0:
                        s.head_left += s.item_s
                    else:
                        s.head_left = 0.0
                        emptied = True
            if emptied:
                self.emptied.extend(s for s in busy if s.queued == 0)
                busy[:] = [s for s in busy if s.queued > 0]
        ran = t - start
        self.busy_s += ran
        self.wanted_s += (until - start) if self.wanting > 0 else ran
        if self.wanting > 1:
            self.contended_s += until - start
        self.clock = until
