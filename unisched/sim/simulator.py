"""A discrete-event simulator that drives the real WeightedFairShare the way freezer enforcement does.

Each slice: `decide(now)`; freeze the waiting tenants and thaw the others (running and idle ones, so that an
idle tenant can start work and be seen); run the simulated GPUs for `slice_s`, activity changes included;
then measure each tenant's GPU time in the slice on each resource (the drain of a frozen tenant's queue
included, as a real GPU shows it), `charge` it, and update demand from what was observed: a thawed tenant
that used nothing loses its demand (after `idle_slices` such slices), a frozen one keeps its last demand,
and an idle thawed tenant that starts work gains demand on the resources it used.

What is fair is judged from the workload, not from the policy's view: while a tenant has work ("on"), it is
owed its weight share, w / (sum of the weights of the tenants with work there), of each resource's busy time.

Pure and deterministic: simulated time only; the one optional input from outside is `timer`, used to
measure how long `decide` takes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from unisched.policy import (
    SHARED_SM,
    ContentionMap,
    Decision,
    FairShareConfig,
    PolicyError,
    Resource,
    TenantSpec,
    WeightedFairShare,
)
from unisched.sim.gpu import SimResource, SimStream
from unisched.sim.results import WAKE_SLACK_SLICES, ResourceResult, SimResult, TenantResult, WakeEvent
from unisched.sim.workload import SimTenant

__all__ = ["SimConfig", "Simulation"]

WAKE_FOLLOW_SLICES = 40
"""How long a wake-up is followed (or until the tenant's work ends)."""


@dataclass(frozen=True)
class SimConfig:
    policy: FairShareConfig = field(default_factory=FairShareConfig)
    contention: ContentionMap = SHARED_SM
    idle_slices: int = 1
    """Slices a thawed tenant may show no use before it loses its demand."""
    seed: int = 0
    timeslice_efficiency: float = 1.0
    """Work a domain does per second while it time-slices two or more tenants' queued work (sim.gpu)."""

    def __post_init__(self) -> None:
        if self.idle_slices < 1:
            raise PolicyError("idle_slices must be >= 1")
        if not 0.0 < self.timeslice_efficiency <= 1.0:
            raise PolicyError(f"timeslice_efficiency must be within (0, 1], got {self.timeslice_efficiency}")


class _Tenant:
    __slots__ = ("by_resource", "demand", "frozen", "idle_run", "next_change", "on", "spec", "start", "streams")

    def __init__(self, spec: SimTenant) -> None:
        self.spec = spec
        self.streams: list[SimStream] = []
        self.by_resource: dict[Resource, list[SimStream]] = {}
        self.frozen = False
        self.on = False
        self.demand: frozenset[Resource] = frozenset()
        self.idle_run = 0
        self.start: dict[Resource, float] = {}
        """The resource's fair-share integral when the tenant's work began (measured window only)."""
        self.next_change = math.inf


class _Wake:
    __slots__ = ("at", "below", "debt", "ended", "fair0", "got0", "name", "ok", "resource", "share", "slices", "to_run")

    def __init__(
        self, name: str, at: float, resource: SimResource, share: float, got0: float, fair0: float, debt: float
    ) -> None:
        self.name = name
        self.at = at
        self.resource = resource
        self.share = share
        self.got0 = got0
        self.fair0 = fair0
        self.debt = debt
        self.to_run: int | None = None
        self.slices = 0
        self.below = 0
        """The last slice end at which it was below its share."""
        self.ok = False
        self.ended = False

    @property
    def to_share(self) -> int | None:
        return self.below + 1 if self.ok else None


class Simulation:
    """Simulated GPUs and tenants around a real `WeightedFairShare` (`self.policy`)."""

    def __init__(
        self,
        tenants: Iterable[SimTenant],
        config: SimConfig | None = None,
        *,
        timer: Callable[[], int] | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.policy = WeightedFairShare(self.config.policy)
        self.now = 0.0
        self.slices = 0
        self._timer = timer
        self._rng = random.Random(self.config.seed)
        self._tenants: dict[str, _Tenant] = {}
        self._resources: dict[Resource, SimResource] = {}
        self._changes: list[tuple[float, int, str]] = []
        self._seq = 0
        self._frozen: frozenset[str] = frozenset()
        self._demand_on: dict[Resource, set[str]] = {}
        # measurement (the window starts at start_measuring)
        self._measuring = False
        self._window_start = 0.0
        self._fair_integral: dict[Resource, float] = {}
        """Per resource, the integral of busy time / sum of the weights of the tenants with work there."""
        self._on_weight: dict[Resource, int] = {}
        self._used: dict[tuple[str, Resource], float] = {}
        self._expected: dict[tuple[str, Resource], float] = {}
        self._done_at_start: dict[str, int] = {}
        self._at_start: dict[Resource, tuple[float, float, float]] = {}
        self._decide_ns: list[int] = []
        self._wakes: list[_Wake] = []
        self._pending: list[_Wake] = []
        for spec in tenants:
            self.add(spec)

    # --- setup ------------------------------------------------------------------------------------
    def add(self, spec: SimTenant) -> None:
        if spec.name in self._tenants:
            raise PolicyError(f"tenant {spec.name!r} added twice")
        self.policy.upsert(TenantSpec(spec.name, spec.weight, spec.priority))
        if spec.min_run_s:
            self.policy.set_min_run(spec.name, spec.min_run_s)
        t = _Tenant(spec)
        for s in spec.streams:
            r = Resource(s.gpu, self.config.contention.domain(s.engine))
            res = self._resources.get(r)
            if res is None:
                res = self._resources[r] = SimResource(r, self.config.timeslice_efficiency)
                res.clock = self.now
                self._fair_integral[r] = 0.0
                self._on_weight[r] = 0
                self._demand_on[r] = set()
            stream = SimStream(spec.name, s, res)
            t.streams.append(stream)
            t.by_resource.setdefault(r, []).append(stream)
        self._tenants[spec.name] = t
        start = max(spec.activity.start_s, self.now)
        if math.isfinite(start):
            self._schedule(t, start)

    def used(self, name: str) -> dict[Resource, float]:
        """GPU seconds the tenant's work has run so far, per resource (drain after freezes included)."""
        t = self._tenants[name]
        return {r: sum(s.used for s in streams) for r, streams in t.by_resource.items()}

    def frozen(self, name: str) -> bool:
        return self._tenants[name].frozen

    def items(self, name: str) -> int:
        """Work items the tenant has completed so far."""
        return sum(s.done for s in self._tenants[name].streams)

    def _schedule(self, t: _Tenant, at: float) -> None:
        t.next_change = at
        self._seq += 1
        heapq.heappush(self._changes, (at, self._seq, t.spec.name))

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, duration_s: float, measure_from_s: float = 0.0) -> SimResult:
        """Simulate until `duration_s`, measuring from `measure_from_s` on; returns the measurements."""
        while self.now < duration_s - 1e-9:
            if not self._measuring and self.now >= measure_from_s - 1e-9:
                self.start_measuring()
            self.step()
        return self.result()

    def start_measuring(self) -> None:
        self._measuring = True
        self._window_start = self.now
        for t in self._tenants.values():
            self._done_at_start[t.spec.name] = sum(s.done for s in t.streams)
            if t.on:
                for r in t.by_resource:
                    t.start[r] = self._fair_integral[r]
        for r, res in self._resources.items():
            self._at_start[r] = (res.busy_s, res.wanted_s, res.contended_s)

    def step(self) -> Decision:
        """One slice, as the engine runs it. Returns the decision that governed it."""
        now = self.now
        timer = self._timer
        if timer is not None:
            t0 = timer()
            decision = self.policy.decide(now)
            cost = timer() - t0
            if self._measuring:
                self._decide_ns.append(cost)
        else:
            decision = self.policy.decide(now)
        for w in self._pending:
            if w.to_run is None and w.name in decision.running:
                w.to_run = w.slices

        # freeze the waiting, thaw everyone else
        tenants = self._tenants
        frozen = decision.waiting
        for name in frozen - self._frozen:
            t = tenants[name]
            t.frozen = True
            for s in t.streams:
                s.submitting = False
        for name in self._frozen - frozen:
            t = tenants[name]
            t.frozen = False
            if t.on:
                for s in t.streams:
                    s.submitting = True
                    s.fill()
        self._frozen = frozen

        end = now + decision.slice_s
        changes = self._changes
        while changes and changes[0][0] < end:
            at, _, name = heapq.heappop(changes)
            t = tenants[name]
            if at == t.next_change:
                self._advance(at)
                self._toggle(t, at)
        self._advance(end)
        self.now = end
        self.slices += 1
        self._observe(decision, end)
        return decision

    def _advance(self, until: float) -> None:
        measuring = self._measuring
        for r, res in self._resources.items():
            before = res.busy_s
            res.advance(until)
            if measuring and self._on_weight[r] > 0:
                self._fair_integral[r] += (res.busy_s - before) / self._on_weight[r]

    def _toggle(self, t: _Tenant, at: float) -> None:
        act = t.spec.activity
        t.on = not t.on
        w = t.spec.weight
        for r in t.by_resource:
            res = self._resources[r]
            if t.on:
                res.wanting += 1
                self._on_weight[r] += w
                t.start[r] = self._fair_integral[r]
            else:
                res.wanting -= 1
                self._on_weight[r] -= w
                if self._measuring:
                    self._owe(t, r)
        if t.on:
            if not t.frozen:
                if at > 0 and self._measuring and not t.demand and t.streams:
                    self._wake(t, at)
                for s in t.streams:
                    s.submitting = True
                    s.fill()
            duration = act.on_s
        else:
            for s in t.streams:
                s.submitting = False
            for wk in self._pending:
                if wk.name == t.spec.name:
                    wk.ended = True
            duration = act.off_s
        if math.isfinite(duration):
            if act.jitter:
                duration = self._rng.expovariate(1.0 / duration)
            self._schedule(t, at + duration)

    def _owe(self, t: _Tenant, r: Resource) -> None:
        """Book what the tenant was owed on `r` since its work (or the window) began."""
        key = (t.spec.name, r)
        owed = t.spec.weight * (self._fair_integral[r] - t.start.get(r, self._fair_integral[r]))
        self._expected[key] = self._expected.get(key, 0.0) + owed
        t.start[r] = self._fair_integral[r]

    def _wake(self, t: _Tenant, at: float) -> None:
        res = t.streams[0].resource
        r = res.resource
        w = t.spec.weight
        share = w / self._on_weight[r]
        debt = 0.0
        others = self._demand_on[r]
        if others:
            vtimes = self.policy.vtimes()
            mine = vtimes[t.spec.name].get(r)
            if mine is not None:
                lowest = min(vtimes[n][r] for n in others)
                debt = max(0.0, (mine - lowest) * w)
        got0 = sum(s.used for s in t.by_resource[r])
        wake = _Wake(t.spec.name, at, res, share, got0, self._fair_integral[r], debt)
        self._wakes.append(wake)
        self._pending.append(wake)

    def _observe(self, decision: Decision, now: float) -> None:
        """Measure the slice that just ended: charge, update demand, follow wake-ups."""
        tenants = self._tenants
        policy = self.policy
        measuring = self._measuring
        used: dict[str, dict[Resource, float]] = {}
        for res in self._resources.values():
            r = res.resource
            for group in (res.busy, res.emptied):
                for st in group:
                    if st.slice_used > 0:
                        per = used.setdefault(st.owner, {})
                        per[r] = per.get(r, 0.0) + st.slice_used
                        st.slice_used = 0.0
            res.emptied.clear()
        for name, per in used.items():
            for r, seconds in per.items():
                policy.charge(name, r, seconds, now)
                if measuring:
                    key = (name, r)
                    self._used[key] = self._used.get(key, 0.0) + seconds
        # demand, from what thawed tenants showed
        idle_slices = self.config.idle_slices
        for name, per in used.items():
            t = tenants[name]
            if not t.frozen:
                t.idle_run = 0
                if frozenset(per) != t.demand:
                    self._set_demand(t, frozenset(per))
        for name in decision.running:
            if name not in used:
                t = tenants[name]
                if not t.frozen and t.demand:
                    t.idle_run += 1
                    if t.idle_run >= idle_slices:
                        self._set_demand(t, frozenset())
        if self._pending:
            self._follow_wakes()

    def _set_demand(self, t: _Tenant, new: frozenset[Resource]) -> None:
        name = t.spec.name
        for r in t.demand - new:
            self._demand_on[r].discard(name)
        for r in new - t.demand:
            self._demand_on[r].add(name)
        t.demand = new
        self.policy.set_demand(name, new)

    def _follow_wakes(self) -> None:
        slack = WAKE_SLACK_SLICES * self.config.policy.slice_s
        still = []
        for w in self._pending:
            w.slices += 1
            t = self._tenants[w.name]
            r = w.resource.resource
            got = sum(s.used for s in t.by_resource[r]) - w.got0
            owed = t.spec.weight * (self._fair_integral[r] - w.fair0)
            w.ok = got >= owed - slack
            if not w.ok:
                w.below = w.slices
            if not (w.ended or w.slices >= WAKE_FOLLOW_SLICES):
                still.append(w)
        self._pending = still

    # --- results ----------------------------------------------------------------------------------
    def result(self) -> SimResult:
        """The measurements so far (the window runs from start_measuring to now)."""
        window = self.now - self._window_start if self._measuring else 0.0
        expected = dict(self._expected)
        if self._measuring:
            for t in self._tenants.values():
                if t.on:
                    for r in t.by_resource:
                        key = (t.spec.name, r)
                        owed = t.spec.weight * (self._fair_integral[r] - t.start.get(r, self._fair_integral[r]))
                        expected[key] = expected.get(key, 0.0) + owed
        tenant_results = []
        for name, t in self._tenants.items():
            gpu_s = {r: self._used.get((name, r), 0.0) for r in t.by_resource}
            exp = {r: expected.get((name, r), 0.0) for r in t.by_resource}
            items = sum(s.done for s in t.streams) - self._done_at_start.get(name, 0)
            tenant_results.append(TenantResult(name, t.spec.weight, gpu_s, exp, items))
        resource_results = []
        for r, res in self._resources.items():
            busy0, wanted0, contended0 = self._at_start.get(r, (0.0, 0.0, 0.0))
            resource_results.append(
                ResourceResult(r, res.busy_s - busy0, res.wanted_s - wanted0, res.contended_s - contended0)
            )
        wakes = tuple(
            WakeEvent(w.name, w.at, w.resource.resource, w.share, w.debt, w.to_run, w.to_share)
            for w in self._wakes
            if w.slices > 0
        )
        return SimResult(
            window_s=window,
            slices=self.slices,
            tenants=tuple(tenant_results),
            resources=tuple(sorted(resource_results, key=lambda x: x.resource)),
            wakes=wakes,
            decide_ns=tuple(self._decide_ns),
        )
