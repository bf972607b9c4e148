"""Weighted fair sharing of GPU resources by virtual time (the fairness math of unisched).

Each tenant keeps a virtual time per resource it uses: charging `s` GPU-seconds on a resource advances it
by `s / weight`. Each decision hands every contended resource to the runnable tenant furthest behind
(lowest virtual time relative to the resource's virtual clock), greedily, so tenants that do not contend
run together. Charges are what was *measured* (including the drain of queued work after a freeze), so
the loop is closed: whatever a slice really cost is paid back by waiting, and measured shares converge
to the weights whatever the slice length or drain.

Work conservation: only tenants with demand take part; an idle tenant neither runs a slice nor
accumulates credit beyond the lag limit, so it cannot hoard the GPU when it wakes, and it gets its share
back at the first decision after its demand is seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from unisched.policy.model import (
    DEFAULT_WEIGHT,
    Mode,
    PolicyError,
    Priority,
    Resource,
    TenantSpec,
    validate_weight,
)

__all__ = ["Decision", "FairShareConfig", "TenantStats", "WeightedFairShare"]


@dataclass(frozen=True)
class FairShareConfig:
    mode: Mode = Mode.SHARED
    slice_s: float = 0.05
    lag_limit_slices: float = 2.0
    """How much credit (in slices of GPU time) a tenant may keep while idle; CFS-style lag clamp."""
    timeshare_window_s: float = 0.1
    """Timeshare mode: a tenant of the default weight runs this long per turn (scaled by weight)."""
    share_window_s: float = 10.0
    """Measured shares are reported over this trailing window."""

    def __post_init__(self) -> None:
        if not 0.001 <= self.slice_s <= 10.0:
            raise PolicyError(f"slice must be within 1 ms .. 10 s, got {self.slice_s} s")
        if self.lag_limit_slices < 0:
            raise PolicyError("lag_limit_slices must be >= 0")
        if self.timeshare_window_s <= 0 or self.share_window_s <= 0:
            raise PolicyError("windows must be positive")


@dataclass(frozen=True)
class Decision:
    """Who holds which resource until the next decision, `slice_s` from now."""

    now: float
    slice_s: float
    running: frozenset[str]
    """Tenants with demand that run this slice (thawed)."""
    waiting: frozenset[str]
    """Tenants with demand that must not run this slice (frozen)."""
    holders: Mapping[Resource, str]


@dataclass(frozen=True)
class TenantStats:
    """One tenant as the policy sees it; the snapshot shared by `tenants`, metrics and logs."""

    name: str
    weight: int
    priority: Priority
    demand: frozenset[Resource]
    target_share: Mapping[Resource, float]
    measured_share: Mapping[Resource, float]
    gpu_seconds: float
    slices: int


@dataclass
class _Tenant:
    spec: TenantSpec
    weight: int
    vtime: dict[Resource, float] = field(default_factory=dict)
    demand: frozenset[Resource] = frozenset()
    gpu_seconds: float = 0.0
    slices: int = 0
    last_run_end: float = float("-inf")
    turn_started: float | None = None
    charges: list[tuple[float, Resource, float]] = field(default_factory=list)


class WeightedFairShare:
    """The scheduler. Pure: the caller passes `now` and what it measured; nothing here sleeps or reads."""

    def __init__(self, config: FairShareConfig | None = None) -> None:
        self.config = config or FairShareConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._vclock: dict[Resource, float] = {}
        self._holders: dict[Resource, str] = {}

    # --- membership -------------------------------------------------------------------------------
    def upsert(self, spec: TenantSpec) -> None:
        t = self._tenants.get(spec.name)
        if t is None:
            self._tenants[spec.name] = _Tenant(spec=spec, weight=spec.weight)
        else:
            t.spec = spec
            t.weight = spec.weight

    def remove(self, name: str) -> None:
        self._get(name)
        del self._tenants[name]
        for r, holder in list(self._holders.items()):
            if holder == name:
                del self._holders[r]

    def set_weight(self, name: str, weight: int) -> None:
        """Effective weight (tidal schedules change it without touching the declared spec)."""
        self._get(name).weight = validate_weight(weight)

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def weight(self, name: str) -> int:
        return self._get(name).weight

    def _get(self, name: str) -> _Tenant:
        try:
            return self._tenants[name]
        except KeyError:
            raise PolicyError(f"unknown tenant {name!r}") from None

    # --- signals ----------------------------------------------------------------------------------
    def set_demand(self, name: str, resources: Iterable[Resource]) -> None:
        """The resources the tenant has work for now. Newly active resources get a clamped lag."""
        t = self._get(name)
        new = frozenset(resources)
        limit = self.config.lag_limit_slices * self.config.slice_s / t.weight
        for r in new - t.demand:
            clock = self._clock(r, exclude=name)
            if r not in t.vtime:
                t.vtime[r] = clock
            else:
                t.vtime[r] = max(t.vtime[r], clock - limit)
        t.demand = new

    def charge(self, name: str, resource: Resource, gpu_seconds: float, now: float) -> None:
        """Measured GPU time the tenant used on `resource` (slice, overrun and drain alike)."""
        if gpu_seconds < 0:
            raise PolicyError(f"negative charge {gpu_seconds}")
        if gpu_seconds == 0:
            return
        t = self._get(name)
        if resource not in t.vtime:
            t.vtime[resource] = self._clock(resource, exclude=name)
        t.vtime[resource] += gpu_seconds / t.weight
        t.gpu_seconds += gpu_seconds
        t.charges.append((now, resource, gpu_seconds))

    def _clock(self, r: Resource, exclude: str | None = None) -> float:
        """The resource's virtual clock: the lowest vtime among tenants active on it (monotonic)."""
        active = [
            t.vtime[r]
            for n, t in self._tenants.items()
            if n != exclude and r in t.demand and r in t.vtime
        ]
        clock = max(self._vclock.get(r, 0.0), min(active)) if active else self._vclock.get(r, 0.0)
        self._vclock[r] = clock
        return clock

    # --- decisions --------------------------------------------------------------------------------
    def decide(self, now: float) -> Decision:
        active = {n: t for n, t in self._tenants.items() if t.demand}
        clocks = {r: self._clock(r) for t in active.values() for r in t.demand}
        mode = self.config.mode

        def lag(t: _Tenant) -> float:
            return max(t.vtime.get(r, clocks[r]) - clocks[r] for r in t.demand)

        def holds(name: str, t: _Tenant) -> bool:
            return any(self._holders.get(r) == name for r in t.demand)

        def rank(item: tuple[str, _Tenant]) -> tuple[float, float, float, str]:
            name, t = item
            cls = 0.0 if (mode is Mode.PREEMPTIVE and t.spec.priority is Priority.ONLINE) else 1.0
            if mode is Mode.TIMESHARE:
                in_turn = (
                    holds(name, t)
                    and t.turn_started is not None
                    and now - t.turn_started < self._window(t)
                )
                return (cls, 0.0 if in_turn else 1.0, t.last_run_end, name)
            return (cls, lag(t), 0.0 if holds(name, t) else 1.0, name)

        taken: set[Resource] = set()
        running: set[str] = set()
        holders: dict[Resource, str] = {}
        for name, t in sorted(active.items(), key=rank):
            if t.demand & taken:
                continue
            running.add(name)
            taken |= t.demand
            for r in t.demand:
                holders[r] = name
        for name, t in self._tenants.items():
            was_running = holds(name, t) or (t.turn_started is not None)
            if name in running:
                t.slices += 1
                if t.turn_started is None or not holds(name, t):
                    t.turn_started = now
            elif was_running:
                t.turn_started = None
                t.last_run_end = now
        self._holders = holders
        slice_s = self.config.slice_s
        if mode is Mode.TIMESHARE and running:
            remaining = [
                self._window(self._tenants[n]) - (now - (self._tenants[n].turn_started or now))
                for n in running
            ]
            slice_s = max(0.001, min(max(remaining), slice_s * 4))
        return Decision(
            now=now,
            slice_s=slice_s,
            running=frozenset(running),
            waiting=frozenset(active) - running,
            holders=dict(holders),
        )

    def _window(self, t: _Tenant) -> float:
        return self.config.timeshare_window_s * t.weight / DEFAULT_WEIGHT

    # --- reporting --------------------------------------------------------------------------------
    def target_shares(self) -> dict[str, dict[Resource, float]]:
        """Weight share of each resource among tenants active on it (work-conserving targets).

        An idle tenant's target is the share it would get on waking, so `tenants` shows what it is owed.
        """
        weights: dict[Resource, int] = {}
        for t in self._tenants.values():
            for r in t.demand:
                weights[r] = weights.get(r, 0) + t.weight
        out: dict[str, dict[Resource, float]] = {}
        for n, t in self._tenants.items():
            resources = t.demand or frozenset(r for r in t.vtime)
            out[n] = {
                r: t.weight / (weights.get(r, 0) + (0 if r in t.demand else t.weight))
                for r in resources
            }
        return out

    def stats(self, now: float) -> list[TenantStats]:
        horizon = now - self.config.share_window_s
        totals: dict[Resource, float] = {}
        for t in self._tenants.values():
            t.charges = [c for c in t.charges if c[0] >= horizon]
            for _, r, s in t.charges:
                totals[r] = totals.get(r, 0.0) + s
        targets = self.target_shares()
        out = []
        for n in sorted(self._tenants):
            t = self._tenants[n]
            used: dict[Resource, float] = {}
            for _, r, s in t.charges:
                used[r] = used.get(r, 0.0) + s
            out.append(
                TenantStats(
                    name=n,
                    weight=t.weight,
                    priority=t.spec.priority,
                    demand=t.demand,
                    target_share=targets[n],
                    measured_share={r: used[r] / totals[r] for r in used if totals[r] > 0},
                    gpu_seconds=t.gpu_seconds,
                    slices=t.slices,
                )
            )
        return out

    def vtimes(self) -> Mapping[str, Mapping[Resource, float]]:
        return {n: dict(t.vtime) for n, t in self._tenants.items()}
