"""`WeightedFairShare`: the fair share as the engine and the simulator call it (membership, signals, decisions,
reporting); its state is a `Book` and its decisions are decide.py's."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from unisched.policy.fairshare import decide as deciding
from unisched.policy.fairshare.book import (
    Book,
    Decision,
    FairShareConfig,
    Tenant,
    TenantStats,
    get,
    prune,
    reindex,
    resource_id,
    reweigh,
    unindex,
    virtual_clock,
)
from unisched.policy.fairshare.heaps import VALUE
from unisched.policy.model import ChargeKind, PolicyError, Priority, Resource, TenantSpec, validate_weight

__all__ = ["WeightedFairShare"]


class WeightedFairShare:
    """The scheduler. Pure: the caller passes `now` and what it measured; nothing here sleeps or reads."""

    def __init__(self, config: FairShareConfig | None = None) -> None:
        self._b = Book(config or FairShareConfig())

    @property
    def config(self) -> FairShareConfig:
        return self._b.config

    def decide(self, now: float) -> Decision:
        """Who holds which resource until the next decision (decide.py)."""
        return deciding.decide(self._b, now)

    def upsert(self, spec: TenantSpec) -> None:
        t = self._b.tenants.get(spec.name)
        if t is None:
            self._b.tenants[spec.name] = Tenant(spec=spec, weight=spec.weight)
        elif spec.priority is not t.spec.priority and t.demand and self._b.by_class:
            unindex(self._b, t)
            t.spec = spec
            reweigh(self._b, t, spec.weight)
            reindex(self._b, t)
        else:
            t.spec = spec
            reweigh(self._b, t, spec.weight)


    def remove(self, name: str) -> None:
        t = get(self._b, name)
        unindex(self._b, t)
        for r in t.demand:
            self._b.demand_weight[r] -= t.weight
        for r, used in t.window.items():  # its charges leave the measured shares now, not when they expire
            self._b.window_total[r] -= used
        t.window.clear()
        t.removed = True
        del self._b.tenants[name]
        if name in self._b.active:
            self._b.active.discard(name)
            self._b.active_frozen = None
        self._b.in_turn.discard(name)
        for rid, holder in list(self._b.holders.items()):
            if holder == name:
                del self._b.holders[rid]


    def set_weight(self, name: str, weight: int) -> None:
        """Effective weight (tidal schedules change it without touching the declared spec)."""
        reweigh(self._b, get(self._b, name), validate_weight(weight))


    def set_min_run(self, name: str, seconds: float) -> None:
        """A holder keeps its resource at least this long against tenants of its own class that were already
        waiting when its turn began (a higher class still preempts it, a tenant that wakes during the turn takes
        its share back at the next decision, and it hands over at once when its demand ends). For work whose
        hand-overs cost (queued units time-sliced beside the next holder's, the GPU idle until its first launch):
        fewer, longer turns. Charges are unchanged, so shares converge to the weights as before,
        over longer turns. 0 turns it off; timeshare mode and multi-resource tenants ignore it."""
        if not (0.0 <= seconds <= 10.0):
            raise PolicyError(f"minimum run must be within 0 .. 10 s, got {seconds!r}")
        get(self._b, name).min_run_s = seconds


    def min_run_left(self, name: str, now: float) -> float:
        """How long the tenant's minimum run still holds it in place (0 when none, or not in a turn)."""
        t = self._b.tenants.get(name)
        if t is None or not t.min_run_s or t.turn_started is None:
            return 0.0
        return max(0.0, t.turn_started + t.min_run_s - now)


    def names(self) -> list[str]:
        return sorted(self._b.tenants)

    def has(self, name: str) -> bool:
        return name in self._b.tenants


    def contenders(self, resource: Resource) -> int:
        """How many tenants have demand on the resource now (a lease holder alone need not stop early)."""
        rid = self._b.rids.get(resource)
        return 0 if rid is None else self._b.index[rid].active


    def weight(self, name: str) -> int:
        return get(self._b, name).weight


    def lead(self, name: str, resource: Resource) -> float:
        """GPU seconds the tenant has had on `resource` beyond its weight share: its virtual time less the
        resource's virtual clock (the lowest among the tenants that want it), times its weight; 0 where it has none."""
        t = get(self._b, name)
        v = t.vtime.get(resource)
        rid = self._b.rids.get(resource)
        if v is None or rid is None:
            return 0.0
        return max(0.0, (v - virtual_clock(self._b, rid)) * t.weight)


    def priority(self, name: str) -> Priority:
        return get(self._b, name).spec.priority


    def set_demand(self, name: str, resources: Iterable[Resource]) -> None:
        """The resources the tenant has work for now. Newly active resources get a clamped lag."""
        t = get(self._b, name)
        new = resources if isinstance(resources, frozenset) else frozenset(resources)
        if new == t.demand:
            return
        limit = self._b.config.lag_limit_slices * self._b.config.slice_s / t.weight
        for r in new - t.demand:
            clock = virtual_clock(self._b, resource_id(self._b, r))
            if r not in t.vtime:
                t.vtime[r] = clock
            else:
                t.vtime[r] = max(t.vtime[r], clock - limit)
        unindex(self._b, t)
        dw = self._b.demand_weight
        for r in t.demand:
            dw[r] -= t.weight
        for r in new:
            dw[r] = dw.get(r, 0) + t.weight
        if new and not t.demand:
            self._b.activations += 1
            t.activated = self._b.activations
        t.demand = new
        reindex(self._b, t)
        if new:
            if name not in self._b.active:
                self._b.active.add(name)
                self._b.active_frozen = None
        elif name in self._b.active:
            self._b.active.discard(name)
            self._b.active_frozen = None


    def level(self, resource: Resource) -> None:
        """Start weighted sharing of `resource` with nobody owed: every tenant wanting it gets the same virtual time
        (the highest among them). For the moment it becomes saturated after a stretch in which every tenant ran as
        much as it wanted: nobody was deprived then, so nobody is owed catch-up time now."""
        members = [t for t in self._b.tenants.values() if resource in t.demand]
        if len(members) < 2:
            return
        top = max(t.vtime.get(resource, 0.0) for t in members)
        for t in members:
            if t.vtime.get(resource) != top:
                unindex(self._b, t)
                t.vtime[resource] = top
                reindex(self._b, t)


    def charge(self, name: str, resource: Resource, gpu_seconds: float, now: float, kind: ChargeKind | None = None) -> None:
        """Measured GPU time the tenant used on `resource` (slice, overrun and drain alike). `kind`: the rule and
        source it came by, kept apart per tenant (`TenantStats.charged_as`) so that a share can be traced to the part
        of the charging model that set it; the vtime does not depend on it."""
        if not (gpu_seconds >= 0 and math.isfinite(gpu_seconds)):
            raise PolicyError(f"charge must be a finite number of seconds >= 0, got {gpu_seconds}")
        if gpu_seconds == 0:
            return
        t = get(self._b, name)
        vtime = t.vtime
        if resource not in vtime:
            vtime[resource] = virtual_clock(self._b, resource_id(self._b, resource))
        v = vtime[resource] + gpu_seconds / t.weight
        vtime[resource] = v
        if t.entries:
            entry = t.entries.get(self._b.rids[resource])
            if entry is not None:
                entry[VALUE] = v  # its heap place is fixed when it reaches the top
        t.gpu_seconds += gpu_seconds
        t.seconds_by[resource] = t.seconds_by.get(resource, 0.0) + gpu_seconds
        if kind is not None:
            key = (resource, kind)
            t.charged_as[key] = t.charged_as.get(key, 0.0) + gpu_seconds
        t.window[resource] = t.window.get(resource, 0.0) + gpu_seconds
        self._b.window_total[resource] = self._b.window_total.get(resource, 0.0) + gpu_seconds
        self._b.charges.append((now, t, resource, gpu_seconds))
        prune(self._b, now)


    def target_shares(self, names: Iterable[str] | None = None) -> dict[str, dict[Resource, float]]:
        """Weight share of each resource among tenants active on it (work-conserving targets), for every
        tenant or for `names`.

        An idle tenant's target is the share it would get on waking, so `tenants` shows what it is owed.
        """
        weights = self._b.demand_weight
        out: dict[str, dict[Resource, float]] = {}
        for n in self._b.tenants if names is None else names:
            t = self._b.tenants[n]
            resources = t.demand or frozenset(r for r in t.vtime)
            out[n] = {
                r: t.weight / (weights.get(r, 0) + (0 if r in t.demand else t.weight))
                for r in resources
            }
        return out


    def stats(self, now: float, names: Iterable[str] | None = None) -> list[TenantStats]:
        """Every tenant's stats, or those of `names` only (cheap: a tenant's own sums, kept as charges come)."""
        prune(self._b, now)
        wanted = sorted(self._b.tenants) if names is None else sorted(names)
        targets = self.target_shares(wanted)
        totals = self._b.window_total
        out = []
        for n in wanted:
            t = self._b.tenants[n]
            out.append(
                TenantStats(
                    name=n,
                    weight=t.weight,
                    priority=t.spec.priority,
                    demand=t.demand,
                    target_share=targets[n],
                    measured_share={
                        r: max(0.0, used) / totals[r]
                        for r, used in t.window.items() if used > 1e-12 and totals.get(r, 0.0) > 1e-12
                    },
                    gpu_seconds=t.gpu_seconds,
                    slices=t.slices,
                    seconds_by=dict(t.seconds_by),
                    charged_as=dict(t.charged_as),
                )
            )
        return out


    def vtimes(self) -> Mapping[str, Mapping[Resource, float]]:
        return {n: dict(t.vtime) for n, t in self._b.tenants.items()}
