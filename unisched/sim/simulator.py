"""A discrete-event simulator that drives the real WeightedFairShare the way the kernel engine does.

Each slice: `decide(now)`; freeze the waiting tenants and thaw the others (running and idle ones, so that an
idle tenant can start work and be seen); run the simulated GPUs for `slice_s`, activity changes included;
then measure each tenant's GPU time in the slice on each resource (the drain of a frozen tenant's queue
included, as a real GPU shows it), `charge` it, and update demand from what was observed: a thawed tenant
that used nothing loses its demand (after `idle_slices` such slices), a frozen one keeps its last demand,
and an idle thawed tenant that starts work gains demand on the resources it used.

Pure and deterministic: simulated time only; the one optional input from outside is `timer`, used to
measure how long `decide` takes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from unisched.sim.workload import SimTenant

__all__ = ["ResourceResult", "SimConfig", "SimResult", "Simulation", "TenantResult", "WakeEvent", "weight_shares"]

_WAKE_SHARE_FRACTION = 0.9
"""A waking tenant 'has its share' once its GPU time since waking is this fraction of its weight share of
the resource's busy time since waking."""
_WAKE_GIVE_UP_SLICES = 1000


@dataclass(frozen=True)
class SimConfig:
    policy: FairShareConfig = field(default_factory=FairShareConfig)
    contention: ContentionMap = SHARED_SM
    idle_slices: int = 1
    """Slices a thawed tenant may show no use before it loses its demand."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.idle_slices < 1:
            raise PolicyError("idle_slices must be >= 1")


@dataclass(frozen=True)
class WakeEvent:
    tenant: str
    at_s: float
    resource: Resource
    share: float
    """Its weight share of `resource` among the tenants with demand there when it woke."""
    slices_to_run: int | None
    """Decisions after the wake until it was in `running` (None: never, before it went idle again)."""
    slices_to_share: int | None
    """Slice ends after the wake until its GPU time since the wake reached its share (None: never)."""


@dataclass(frozen=True)
class TenantResult:
    name: str
    weight: int
    gpu_s: Mapping[Resource, float]
    """GPU time used in the measured window, per resource."""
    expected_s: Mapping[Resource, float]
    """Its weight share of each resource's busy time while it had demand there (the fair amount)."""
    items: int
    """Work items completed in the measured window (throughput)."""


@dataclass(frozen=True)
class ResourceResult:
    resource: Resource
    busy_s: float
    wanted_s: float
    """Time some tenant had work on it, running or frozen."""
    contended_s: float
    """Time two or more tenants had demand on it."""

    @property
    def efficiency(self) -> float:
        return self.busy_s / self.wanted_s if self.wanted_s > 0 else 1.0


@dataclass(frozen=True)
class SimResult:
    window_s: float
    slices: int
    tenants: tuple[TenantResult, ...]
    resources: tuple[ResourceResult, ...]
    wakes: tuple[WakeEvent, ...]
    decide_ns: tuple[int, ...]

    def shares(self, resource: Resource) -> dict[str, tuple[float, float]]:
        """Per tenant on `resource`: (measured share of its GPU time, weight share of it)."""
        used = {t.name: t.gpu_s.get(resource, 0.0) for t in self.tenants}
        fair = {t.name: t.expected_s.get(resource, 0.0) for t in self.tenants}
        total_used, total_fair = sum(used.values()), sum(fair.values())
        if total_used <= 0 or total_fair <= 0:
            return {}
        return {
            n: (used[n] / total_used, fair[n] / total_fair) for n in used if used[n] > 0 or fair[n] > 0
        }

    def share_error_points(self, contended_only: bool = True) -> float:
        """Max over tenants and resources of |measured share - weight share|, in percentage points."""
        worst = 0.0
        for r in self.resources:
            if contended_only and r.contended_s <= 0:
                continue
            for measured, fair in self.shares(r.resource).values():
                worst = max(worst, abs(measured - fair) * 100.0)
        return worst

    def efficiency(self, contended_only: bool = True) -> tuple[float, float]:
        """(lowest, mean) busy fraction of the resources while some tenant had work on them."""
        effs = [r.efficiency for r in self.resources if r.wanted_s > 0 and (r.contended_s > 0 or not contended_only)]
        if not effs:
            return (1.0, 1.0)
        return (min(effs), sum(effs) / len(effs))


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
        """Value of the resource's fair-share integral when the tenant's demand there began."""
        self.next_change = math.inf


class _Wake:
    __slots__ = ("at", "busy0", "closed", "got0", "name", "resource", "share", "slices", "to_run", "to_share")

    def __init__(self, name: str, at: float, resource: SimResource, share: float, got0: float) -> None:
        self.name = name
        self.at = at
        self.resource = resource
        self.share = share
        self.got0 = got0
        self.busy0 = resource.busy_s
        self.to_run: int | None = None
        self.to_share: int | None = None
        self.slices = 0
        self.closed = False


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
        # measurement
        self._measuring = False
        self._window_start = 0.0
        self._fair_integral: dict[Resource, float] = {}
        """Per resource, the integral of busy time / sum of the weights with demand there."""
        self._active_weight: dict[Resource, int] = {}
        self._active_count: dict[Resource, int] = {}
        self._contended_s: dict[Resource, float] = {}
        self._used: dict[tuple[str, Resource], float] = {}
        self._expected: dict[tuple[str, Resource], float] = {}
        self._done_at_start: dict[str, int] = {}
        self._busy_at_start: dict[Resource, tuple[float, float]] = {}
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
        t = _Tenant(spec)
        for s in spec.streams:
            r = Resource(s.gpu, self.config.contention.domain(s.engine))
            res = self._resources.get(r)
            if res is None:
                res = self._resources[r] = SimResource(r)
                res.clock = self.now
                self._fair_integral[r] = 0.0
                self._active_weight[r] = 0
                self._active_count[r] = 0
                self._contended_s[r] = 0.0
            stream = SimStream(spec.name, s, res)
            t.streams.append(stream)
            t.by_resource.setdefault(r, []).append(stream)
        self._tenants[spec.name] = t
        start = max(spec.activity.start_s, self.now)
        if math.isfinite(start):
            self._schedule(t, start)

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
            for r in t.demand:
                t.start[r] = self._fair_integral[r]
        for r, res in self._resources.items():
            self._busy_at_start[r] = (res.busy_s, res.wanted_s)

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
                w.to_run = w.slices + 1

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
            if at != t.next_change:
                continue
            for res in self._resources.values():
                res.advance(at)
            self._toggle(t, at)
        busy_before = {r: res.busy_s for r, res in self._resources.items()} if self._measuring else {}
        for res in self._resources.values():
            res.advance(end)
        self.now = end
        self.slices += 1
        self._observe(decision, end, busy_before)
        return decision

    def _toggle(self, t: _Tenant, at: float) -> None:
        act = t.spec.activity
        t.on = not t.on
        for s in t.streams:
            s.resource.wanting += 1 if t.on else -1
        if t.on:
            if not t.frozen:
                for s in t.streams:
                    s.submitting = True
                    s.fill()
            if at > 0 and self._measuring and t.streams:
                self._wake(t, at)
            duration = act.on_s
        else:
            for s in t.streams:
                s.submitting = False
            for w in self._pending:
                if w.name == t.spec.name:
                    w.closed = True
            duration = act.off_s
        if math.isfinite(duration):
            if act.jitter:
                duration = self._rng.expovariate(1.0 / duration)
            self._schedule(t, at + duration)

    def _wake(self, t: _Tenant, at: float) -> None:
        res = t.streams[0].resource
        r = res.resource
        others = self._active_weight[r] - (t.spec.weight if r in t.demand else 0)
        share = t.spec.weight / (t.spec.weight + others)
        got0 = sum(s.used for s in t.by_resource[r])
        w = _Wake(t.spec.name, at, res, share, got0)
        self._wakes.append(w)
        self._pending.append(w)

    def _observe(self, decision: Decision, now: float, busy_before: Mapping[Resource, float]) -> None:
        """Measure the slice that just ended: charge, update demand, account."""
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
        if measuring:
            for r, res in self._resources.items():
                ran = res.busy_s - busy_before[r]
                if self._active_weight[r] > 0:
                    self._fair_integral[r] += ran / self._active_weight[r]
                if self._active_count[r] >= 2:
                    self._contended_s[r] += decision.slice_s
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
            self._check_wakes()

    def _set_demand(self, t: _Tenant, new: frozenset[Resource]) -> None:
        old = t.demand
        w = t.spec.weight
        for r in old - new:
            if self._measuring:
                key = (t.spec.name, r)
                self._expected[key] = self._expected.get(key, 0.0) + w * (self._fair_integral[r] - t.start.pop(r, 0.0))
            self._active_weight[r] -= w
            self._active_count[r] -= 1
        for r in new - old:
            t.start[r] = self._fair_integral[r]
            self._active_weight[r] = self._active_weight.get(r, 0) + w
            self._active_count[r] = self._active_count.get(r, 0) + 1
        t.demand = new
        self.policy.set_demand(t.spec.name, new)

    def _check_wakes(self) -> None:
        still = []
        for w in self._pending:
            w.slices += 1
            if w.to_share is None:
                t = self._tenants[w.name]
                got = sum(s.used for s in t.by_resource[w.resource.resource]) - w.got0
                busy = w.resource.busy_s - w.busy0
                if busy > 0 and got >= _WAKE_SHARE_FRACTION * w.share * busy:
                    w.to_share = w.slices
            done = w.to_share is not None and w.to_run is not None
            if not (done or w.closed or w.slices >= _WAKE_GIVE_UP_SLICES):
                still.append(w)
        self._pending = still

    # --- results ----------------------------------------------------------------------------------
    def result(self) -> SimResult:
        window = self.now - self._window_start if self._measuring else 0.0
        expected = dict(self._expected)
        for t in self._tenants.values():
            for r in t.demand:
                if self._measuring:
                    key = (t.spec.name, r)
                    expected[key] = expected.get(key, 0.0) + t.spec.weight * (self._fair_integral[r] - t.start.get(r, 0.0))
        tenant_results = []
        for name, t in self._tenants.items():
            gpu_s = {r: self._used.get((name, r), 0.0) for r in t.by_resource}
            exp = {r: expected.get((name, r), 0.0) for r in t.by_resource}
            items = sum(s.done for s in t.streams) - self._done_at_start.get(name, 0)
            tenant_results.append(TenantResult(name, t.spec.weight, gpu_s, exp, items))
        resource_results = []
        for r, res in self._resources.items():
            busy0, wanted0 = self._busy_at_start.get(r, (0.0, 0.0))
            resource_results.append(
                ResourceResult(r, res.busy_s - busy0, res.wanted_s - wanted0, self._contended_s[r])
            )
        wakes = tuple(
            WakeEvent(w.name, w.at, w.resource.resource, w.share, w.to_run, w.to_share) for w in self._wakes
        )
        return SimResult(
            window_s=window,
            slices=self.slices,
            tenants=tuple(tenant_results),
            resources=tuple(sorted(resource_results, key=lambda x: x.resource)),
            wakes=wakes,
            decide_ns=tuple(self._decide_ns),
        )


def weight_shares(tenants: Sequence[SimTenant]) -> dict[str, float]:
    """Each tenant's weight over the sum (the target when all saturate one resource)."""
    total = sum(t.weight for t in tenants)
    return {t.name: t.weight / total for t in tenants}
