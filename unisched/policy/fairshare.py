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

Cost. `decide` runs every slice, so it never walks the tenant list. Each resource keeps min-heaps (lazy
deletion: a stale entry is marked dead and dropped when it surfaces) of the tenants active on it, split by
priority class and by kind: tenants that use only this resource ("single") and tenants that use several
("multi"). On one resource single tenants rank by virtual time alone (the clock is common), so only the
heap top (and the current holder, which wins ties) can win the resource; a multi-resource tenant can only
win if it is at or ahead of that top, so only those are looked at. The exact greedy then runs over these
few candidates. A decision costs O(R log N + K), R = resources with demand, K = multi-resource tenants
ahead of their resource's best single tenant. `stats` and `target_shares` walk all tenants (reporting).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Any

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
        if not self.lag_limit_slices >= 0:
            raise PolicyError("lag_limit_slices must be >= 0")
        if not (self.timeshare_window_s > 0 and self.share_window_s > 0):
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


# A heap entry is a list so that entries compare in C: [key, name, seq, owner]. The key is the virtual time
# (or, in timeshare mode, the end of the last turn); `seq` makes every entry unique; `owner` is the _Tenant,
# or None once the entry is stale (lazy deletion).
_Entry = list[Any]
_KEY, _NAME, _SEQ, _OWNER = 0, 1, 2, 3
_MULTI, _SINGLE = 0, 1
_ONLINE, _OFFLINE = 0, 1
_TURN_EPS_S = 1e-6
"""A timeshare turn this close to its end is over (slice lengths are sums of floats)."""
_COMPACT_MIN = 64
"""A heap is rebuilt without its stale entries once it is this long and mostly stale."""


@dataclass(slots=True)
class _Tenant:
    spec: TenantSpec
    weight: int
    vtime: dict[Resource, float] = field(default_factory=dict)
    demand: frozenset[Resource] = frozenset()
    gpu_seconds: float = 0.0
    slices: int = 0
    last_run_end: float = float("-inf")
    turn_started: float | None = None
    charges: deque[tuple[float, Resource, float]] = field(default_factory=deque)
    # index bookkeeping (see _Index)
    only: Resource | None = None
    """The one resource of a single-resource tenant; None for idle and multi-resource tenants."""
    slot: int = 0
    """Which heap of each resource holds the tenant: priority class * 2 + kind."""
    entries: dict[Resource, _Entry] = field(default_factory=dict)
    turn_entries: dict[Resource, _Entry] = field(default_factory=dict)


class _Index:
    """The tenants active on one resource, as lazy min-heaps.

    `vt[slot]` (slot = class * 2 + kind) is keyed by virtual time; `turn[kind]` (timeshare mode only) by
    the end of the tenant's last turn and holds only tenants not in a turn now.
    """

    __slots__ = ("active", "turn", "turn_alive", "vt", "vt_alive")

    def __init__(self) -> None:
        self.vt: tuple[list[_Entry], ...] = ([], [], [], [])
        self.vt_alive = [0, 0, 0, 0]
        self.turn: tuple[list[_Entry], ...] = ([], [])
        self.turn_alive = [0, 0]
        self.active = 0


def _push(heap: list[_Entry], alive: int, entry: _Entry) -> list[_Entry]:
    """Push; when the heap is mostly stale entries, rebuild it (in place) from the live ones."""
    heapq.heappush(heap, entry)
    if len(heap) > _COMPACT_MIN and len(heap) > 3 * alive:
        heap[:] = [e for e in heap if e[_OWNER] is not None]
        heapq.heapify(heap)
    return heap


def _holds(holders: Mapping[Resource, str], name: str, t: _Tenant) -> bool:
    """Whether the tenant held one of the resources it has demand on."""
    if t.only is not None:
        return holders.get(t.only) == name
    return any(holders.get(r) == name for r in t.demand)


class WeightedFairShare:
    """The scheduler. Pure: the caller passes `now` and what it measured; nothing here sleeps or reads."""

    def __init__(self, config: FairShareConfig | None = None) -> None:
        self.config = config or FairShareConfig()
        self._tenants: dict[str, _Tenant] = {}
        self._vclock: dict[Resource, float] = {}
        self._holders: dict[Resource, str] = {}
        self._index: dict[Resource, _Index] = {}
        self._contended: dict[Resource, _Index] = {}
        """Resources with at least one active tenant (the ones a decision hands out)."""
        self._active: set[str] = set()
        self._active_frozen: frozenset[str] | None = frozenset()
        self._in_turn: set[str] = set()
        """Tenants that ran in the last decision (turn_started is set)."""
        self._turn_index = False
        """Whether the timeshare heaps are kept (only in timeshare mode)."""
        self._seq = count()

    # --- membership -------------------------------------------------------------------------------
    def upsert(self, spec: TenantSpec) -> None:
        t = self._tenants.get(spec.name)
        if t is None:
            self._tenants[spec.name] = _Tenant(spec=spec, weight=spec.weight)
        elif spec.priority is not t.spec.priority and t.demand:
            self._unindex(t)
            t.spec = spec
            t.weight = spec.weight
            self._reindex(t)
        else:
            t.spec = spec
            t.weight = spec.weight

    def remove(self, name: str) -> None:
        t = self._get(name)
        self._unindex(t)
        del self._tenants[name]
        if name in self._active:
            self._active.discard(name)
            self._active_frozen = None
        self._in_turn.discard(name)
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
        new = resources if isinstance(resources, frozenset) else frozenset(resources)
        if new == t.demand:
            return
        limit = self.config.lag_limit_slices * self.config.slice_s / t.weight
        for r in new - t.demand:
            clock = self._clock(r)
            if r not in t.vtime:
                t.vtime[r] = clock
            else:
                t.vtime[r] = max(t.vtime[r], clock - limit)
        self._unindex(t)
        t.demand = new
        self._reindex(t)
        if new:
            if name not in self._active:
                self._active.add(name)
                self._active_frozen = None
        elif name in self._active:
            self._active.discard(name)
            self._active_frozen = None

    def charge(self, name: str, resource: Resource, gpu_seconds: float, now: float) -> None:
        """Measured GPU time the tenant used on `resource` (slice, overrun and drain alike)."""
        if not (gpu_seconds >= 0 and math.isfinite(gpu_seconds)):
            raise PolicyError(f"charge must be a finite number of seconds >= 0, got {gpu_seconds}")
        if gpu_seconds == 0:
            return
        t = self._get(name)
        if resource not in t.vtime:
            t.vtime[resource] = self._clock(resource)
        v = t.vtime[resource] + gpu_seconds / t.weight
        t.vtime[resource] = v
        old = t.entries.get(resource)
        if old is not None:
            old[_OWNER] = None
            idx = self._index[resource]
            entry = [v, old[_NAME], next(self._seq), t]
            t.entries[resource] = entry
            _push(idx.vt[t.slot], idx.vt_alive[t.slot], entry)
        t.gpu_seconds += gpu_seconds
        charges = t.charges
        charges.append((now, resource, gpu_seconds))
        horizon = now - self.config.share_window_s
        while charges[0][0] < horizon:
            charges.popleft()

    def _clock(self, r: Resource) -> float:
        """The resource's virtual clock: the lowest vtime among tenants active on it (monotonic)."""
        clock = self._vclock.get(r, 0.0)
        idx = self._contended.get(r)
        if idx is not None:
            for h in idx.vt:
                while h and h[0][_OWNER] is None:
                    heapq.heappop(h)
            clock = max(clock, min((h[0][_KEY] for h in idx.vt if h), default=clock))
        self._vclock[r] = clock
        return clock

    # --- index maintenance ------------------------------------------------------------------------
    def _reindex(self, t: _Tenant) -> None:
        """Enter an (unindexed) tenant into the heaps of every resource it has demand on."""
        demand = t.demand
        if not demand:
            t.only = None
            return
        kind = _SINGLE if len(demand) == 1 else _MULTI
        t.only = next(iter(demand)) if kind == _SINGLE else None
        t.slot = (_ONLINE if t.spec.priority is Priority.ONLINE else _OFFLINE) * 2 + kind
        name = t.spec.name
        for r in demand:
            idx = self._index.get(r)
            if idx is None:
                idx = self._index[r] = _Index()
            entry = [t.vtime[r], name, next(self._seq), t]
            t.entries[r] = entry
            idx.vt_alive[t.slot] += 1
            _push(idx.vt[t.slot], idx.vt_alive[t.slot], entry)
            idx.active += 1
            if idx.active == 1:
                self._contended[r] = idx
        if self._turn_index and t.turn_started is None:
            self._enter_turn_queue(t)

    def _unindex(self, t: _Tenant) -> None:
        for r, entry in t.entries.items():
            entry[_OWNER] = None
            idx = self._index[r]
            idx.vt_alive[t.slot] -= 1
            idx.active -= 1
            if idx.active == 0:
                del self._contended[r]
        t.entries.clear()
        self._leave_turn_queue(t)

    def _enter_turn_queue(self, t: _Tenant) -> None:
        kind = _SINGLE if len(t.demand) == 1 else _MULTI
        for r in t.demand:
            idx = self._index[r]
            entry = [t.last_run_end, t.spec.name, next(self._seq), t]
            t.turn_entries[r] = entry
            idx.turn_alive[kind] += 1
            _push(idx.turn[kind], idx.turn_alive[kind], entry)

    def _leave_turn_queue(self, t: _Tenant) -> None:
        if not t.turn_entries:
            return
        kind = _SINGLE if len(t.turn_entries) == 1 else _MULTI
        for r, entry in t.turn_entries.items():
            entry[_OWNER] = None
            self._index[r].turn_alive[kind] -= 1
        t.turn_entries.clear()

    def _set_turn_index(self, on: bool) -> None:
        """Build (timeshare mode) or drop the heaps keyed by the end of each tenant's last turn."""
        self._turn_index = on
        for t in self._tenants.values():
            self._leave_turn_queue(t)
        for idx in self._index.values():
            idx.turn = ([], [])
            idx.turn_alive = [0, 0]
        if on:
            for t in self._tenants.values():
                if t.demand and t.turn_started is None:
                    self._enter_turn_queue(t)

    # --- decisions --------------------------------------------------------------------------------
    def decide(self, now: float) -> Decision:
        mode = self.config.mode
        timeshare = mode is Mode.TIMESHARE
        if timeshare is not self._turn_index:
            self._set_turn_index(timeshare)
        preemptive = mode is Mode.PREEMPTIVE
        tenants = self._tenants
        prev = self._holders
        vclock = self._vclock
        heappop = heapq.heappop
        inf = math.inf

        # 1. clocks, and the few tenants that can win each resource
        clocks: dict[Resource, float] = {}
        cands: dict[str, _Tenant] = {}
        for r, idx in self._contended.items():
            vt = idx.vt
            lowest = inf
            for h in vt:
                if h:
                    while h[0][_OWNER] is None:
                        heappop(h)
                        if not h:
                            break
                    else:
                        if h[0][_KEY] < lowest:
                            lowest = h[0][_KEY]
            clock = vclock.get(r, 0.0)
            if lowest > clock:
                clock = lowest
            vclock[r] = clock
            clocks[r] = clock

            holder = prev.get(r)
            if holder is not None:
                ht = tenants.get(holder)
                if ht is not None and r in ht.demand:
                    cands[holder] = ht
            if timeshare:
                singles, multis = idx.turn[_SINGLE], idx.turn[_MULTI]
                bound = inf
                if singles:
                    while singles and singles[0][_OWNER] is None:
                        heappop(singles)
                    if singles:
                        top = singles[0]
                        cands[top[_NAME]] = top[_OWNER]
                        bound = top[_KEY]
                if multis:
                    self._take_multis(multis, bound, cands)
                continue
            # single-resource tenants rank by vtime on their one resource: only the top can win
            online_top = inf
            h = vt[_ONLINE * 2 + _SINGLE]
            if h:
                top = h[0]
                cands[top[_NAME]] = top[_OWNER]
                online_top = top[_KEY]
            offline_top = inf
            h = vt[_OFFLINE * 2 + _SINGLE]
            if h:
                top = h[0]
                cands[top[_NAME]] = top[_OWNER]
                offline_top = top[_KEY]
            # a multi-resource tenant must be at or ahead of the best single one on each of its resources
            h = vt[_ONLINE * 2 + _MULTI]
            if h:
                self._take_multis(h, online_top if preemptive else min(online_top, offline_top), cands)
            h = vt[_OFFLINE * 2 + _MULTI]
            if h:
                if not preemptive:
                    self._take_multis(h, min(online_top, offline_top), cands)
                elif online_top == inf:
                    self._take_multis(h, offline_top, cands)
        if timeshare:
            for name in self._in_turn:
                t = tenants[name]
                if t.demand:
                    cands[name] = t

        # 2. rank the candidates exactly as a full sort of every active tenant would
        ranked: list[tuple[float, float, float, str, _Tenant]] = []
        for name, t in cands.items():
            only = t.only
            held = _holds(prev, name, t)
            cls = 0.0 if (preemptive and t.spec.priority is Priority.ONLINE) else 1.0
            if timeshare:
                if t.turn_started is None:
                    ranked.append((cls, 1.0, t.last_run_end, name, t))
                elif held and now - t.turn_started < self._window(t) - _TURN_EPS_S:
                    ranked.append((cls, 0.0, t.last_run_end, name, t))
                else:
                    # its turn is over: behind everyone who waited (round robin)
                    ranked.append((cls, 1.0, now, name, t))
                continue
            lag = t.vtime[only] - clocks[only] if only is not None else max(t.vtime[r] - clocks[r] for r in t.demand)
            ranked.append((cls, lag, 0.0 if held else 1.0, name, t))
        ranked.sort()

        # 3. greedy: best first, skipping tenants one of whose resources is already taken
        taken: set[Resource] = set()
        holders: dict[Resource, str] = {}
        running: list[str] = []
        for _, _, _, name, t in ranked:
            only = t.only
            if only is not None:
                if only in taken:
                    continue
                taken.add(only)
                holders[only] = name
            else:
                if not taken.isdisjoint(t.demand):
                    if timeshare:
                        taken |= t.demand  # keep its free resources for it: no overtaking in turns
                    continue
                taken |= t.demand
                for r in t.demand:
                    holders[r] = name
            running.append(name)

        # 4. turns: who started, continued or stopped running
        in_turn = self._in_turn
        running_set = frozenset(running)
        for name in running:
            t = tenants[name]
            t.slices += 1
            if t.turn_started is None:
                t.turn_started = now
                in_turn.add(name)
                if timeshare:
                    self._leave_turn_queue(t)
            elif not _holds(prev, name, t) or (timeshare and now - t.turn_started >= self._window(t) - _TURN_EPS_S):
                t.turn_started = now
        if len(in_turn) != len(running_set):
            for name in in_turn - running_set:
                t = tenants[name]
                t.turn_started = None
                t.last_run_end = now
                if timeshare and t.demand:
                    self._enter_turn_queue(t)
            in_turn.intersection_update(running_set)
        self._holders = holders

        slice_s = self.config.slice_s
        if timeshare and running:
            remaining = [self._window(tenants[n]) - (now - (tenants[n].turn_started or 0.0)) for n in running]
            slice_s = max(0.001, min(max(remaining), slice_s * 4))
        active = self._active_frozen
        if active is None:
            active = self._active_frozen = frozenset(self._active)
        return Decision(
            now=now,
            slice_s=slice_s,
            running=running_set,
            waiting=active - running_set,
            holders=dict(holders),
        )

    @staticmethod
    def _take_multis(heap: list[_Entry], bound: float, cands: dict[str, _Tenant]) -> None:
        """Add the live entries of `heap` whose key is <= bound to the candidates (stale ones are dropped)."""
        kept: list[_Entry] = []
        while heap and heap[0][_KEY] <= bound:
            entry = heapq.heappop(heap)
            if entry[_OWNER] is not None:
                cands[entry[_NAME]] = entry[_OWNER]
                kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)

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
            t.charges = deque(c for c in t.charges if c[0] >= horizon)
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
