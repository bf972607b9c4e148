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
# (or, in timeshare mode, the end of the tenant's last turn); `seq` makes every entry unique; `owner` is the
# _Tenant, or None once the entry is stale (lazy deletion). A live vtime entry's key is the tenant's vtime.
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
    # Index bookkeeping. Resources are numbered (WeightedFairShare._rid) so that the hot path hashes ints,
    # not Resource dataclasses (whose __hash__ is Python code).
    demand_ids: tuple[int, ...] = ()
    only: int = -1
    """The resource id of a single-resource tenant; -1 for idle and multi-resource tenants."""
    slot: int = 0
    """Which vtime heap of each resource holds the tenant: priority class * 2 + kind."""
    entries: dict[int, _Entry] = field(default_factory=dict)
    turn_entries: dict[int, _Entry] = field(default_factory=dict)
    held: dict[int, dict[Resource, str]] = field(default_factory=dict)
    """{resource: name} per resource id, merged into Decision.holders without hashing the Resource again."""


class _Index:
    """The tenants active on one resource, as lazy min-heaps.

    `vt[slot]` (slot = class * 2 + kind) is keyed by virtual time; `turn[kind]` (timeshare mode only) by
    the end of the tenant's last turn, and holds only tenants that are not in a turn now.
    """

    __slots__ = ("active", "turn", "turn_alive", "vt", "vt_alive")

    def __init__(self) -> None:
        self.vt: tuple[list[_Entry], ...] = ([], [], [], [])
        self.vt_alive = [0, 0, 0, 0]
        self.turn: tuple[list[_Entry], ...] = ([], [])
        self.turn_alive = [0, 0]
        self.active = 0


def _push(heap: list[_Entry], alive: int, entry: _Entry) -> None:
    """Push; when the heap is mostly stale entries, rebuild it (in place) from the live ones."""
    heapq.heappush(heap, entry)
    if len(heap) > _COMPACT_MIN and len(heap) > 3 * alive:
        heap[:] = [e for e in heap if e[_OWNER] is not None]
        heapq.heapify(heap)


def _take_multis(heap: list[_Entry], bound: float, cands: dict[str, _Tenant]) -> None:
    """Add the owners of the live entries of `heap` whose key is <= bound to the candidates.

    Reads the heap without changing it: a scan when it is short, else a walk down from the root that
    stops below entries past the bound (their children are later still).
    """
    if len(heap) <= 32:
        for entry in heap:
            if entry[_KEY] <= bound and entry[_OWNER] is not None:
                cands[entry[_NAME]] = entry[_OWNER]
        return
    n = len(heap)
    stack = [0]
    while stack:
        i = stack.pop()
        entry = heap[i]
        if entry[_KEY] > bound:
            continue
        if entry[_OWNER] is not None:
            cands[entry[_NAME]] = entry[_OWNER]
        i = 2 * i + 1
        if i < n:
            stack.append(i)
            if i + 1 < n:
                stack.append(i + 1)


def _first(item: tuple[tuple[float, float, float, str], _Tenant]) -> tuple[float, float, float, str]:
    return item[0]


def _holds(holders: Mapping[int, str], name: str, t: _Tenant) -> bool:
    """Whether the tenant held one of the resources it has demand on."""
    if t.only >= 0:
        return holders.get(t.only) == name
    return any(holders.get(i) == name for i in t.demand_ids)


class WeightedFairShare:
    """The scheduler. Pure: the caller passes `now` and what it measured; nothing here sleeps or reads."""

    def __init__(self, config: FairShareConfig | None = None) -> None:
        self.config = config or FairShareConfig()
        self._tenants: dict[str, _Tenant] = {}
        # resources, numbered in order of first use
        self._rids: dict[Resource, int] = {}
        self._resources: list[Resource] = []
        self._index: list[_Index] = []
        self._vclock: list[float] = []
        self._contended: dict[int, _Index] = {}
        """Resources with at least one active tenant: the ones a decision hands out."""
        self._holders: dict[int, str] = {}
        self._active: set[str] = set()
        self._active_frozen: frozenset[str] | None = frozenset()
        self._in_turn: set[str] = set()
        """Tenants that run since the last decision (their turn_started is set)."""
        self._turn_index = False
        """Whether the heaps keyed by turn end are kept (timeshare mode only)."""
        self._by_class = self.config.mode is Mode.PREEMPTIVE
        """Whether online tenants have heaps of their own (preemptive mode only; else all share the offline ones)."""
        self._multi = 0
        """How many active tenants have demand on several resources (none: every resource is decided alone)."""
        self._seq = count()

    def _rid(self, r: Resource) -> int:
        rid = self._rids.get(r)
        if rid is None:
            rid = self._rids[r] = len(self._resources)
            self._resources.append(r)
            self._index.append(_Index())
            self._vclock.append(0.0)
        return rid

    # --- membership -------------------------------------------------------------------------------
    def upsert(self, spec: TenantSpec) -> None:
        t = self._tenants.get(spec.name)
        if t is None:
            self._tenants[spec.name] = _Tenant(spec=spec, weight=spec.weight)
        elif spec.priority is not t.spec.priority and t.demand and self._by_class:
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
        for rid, holder in list(self._holders.items()):
            if holder == name:
                del self._holders[rid]

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
            clock = self._clock(self._rid(r))
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
        vtime = t.vtime
        if resource not in vtime:
            vtime[resource] = self._clock(self._rid(resource))
        v = vtime[resource] + gpu_seconds / t.weight
        vtime[resource] = v
        if t.entries:
            rid = self._rids[resource]
            old = t.entries.get(rid)
            if old is not None:
                old[_OWNER] = None
                heap = self._index[rid].vt[t.slot]
                entry = [v, old[_NAME], next(self._seq), t]
                t.entries[rid] = entry
                if heap[0] is old:
                    heapq.heapreplace(heap, entry)  # the usual case: the holder was the lowest
                else:
                    _push(heap, self._index[rid].vt_alive[t.slot], entry)
        t.gpu_seconds += gpu_seconds
        charges = t.charges
        charges.append((now, resource, gpu_seconds))
        horizon = now - self.config.share_window_s
        while charges[0][0] < horizon:
            charges.popleft()

    def _clock(self, rid: int) -> float:
        """The resource's virtual clock: the lowest vtime among tenants active on it (monotonic)."""
        clock = self._vclock[rid]
        idx = self._contended.get(rid)
        if idx is not None:
            for h in idx.vt:
                while h and h[0][_OWNER] is None:
                    heapq.heappop(h)
            clock = max(clock, min((h[0][_KEY] for h in idx.vt if h), default=clock))
        self._vclock[rid] = clock
        return clock

    # --- index maintenance ------------------------------------------------------------------------
    def _reindex(self, t: _Tenant) -> None:
        """Enter an unindexed tenant into the heaps of every resource it has demand on."""
        demand = t.demand
        ids = tuple(self._rid(r) for r in demand)
        t.demand_ids = ids
        if not ids:
            t.only = -1
            return
        kind = _SINGLE if len(ids) == 1 else _MULTI
        t.only = ids[0] if kind == _SINGLE else -1
        online = self._by_class and t.spec.priority is Priority.ONLINE
        t.slot = slot = (_ONLINE if online else _OFFLINE) * 2 + kind
        if kind == _MULTI:
            self._multi += 1
        name = t.spec.name
        for r, rid in zip(demand, ids, strict=True):
            idx = self._index[rid]
            entry = [t.vtime[r], name, next(self._seq), t]
            t.entries[rid] = entry
            idx.vt_alive[slot] += 1
            _push(idx.vt[slot], idx.vt_alive[slot], entry)
            idx.active += 1
            if idx.active == 1:
                self._contended[rid] = idx
        if self._turn_index and t.turn_started is None:
            self._enter_turn_queue(t)

    def _unindex(self, t: _Tenant) -> None:
        if len(t.entries) > 1:
            self._multi -= 1
        for rid, entry in t.entries.items():
            entry[_OWNER] = None
            idx = self._index[rid]
            idx.vt_alive[t.slot] -= 1
            idx.active -= 1
            if idx.active == 0:
                del self._contended[rid]
        t.entries.clear()
        self._leave_turn_queue(t)

    def _enter_turn_queue(self, t: _Tenant) -> None:
        kind = _SINGLE if len(t.demand_ids) == 1 else _MULTI
        for rid in t.demand_ids:
            idx = self._index[rid]
            entry = [t.last_run_end, t.spec.name, next(self._seq), t]
            t.turn_entries[rid] = entry
            idx.turn_alive[kind] += 1
            _push(idx.turn[kind], idx.turn_alive[kind], entry)

    def _leave_turn_queue(self, t: _Tenant) -> None:
        if not t.turn_entries:
            return
        kind = _SINGLE if len(t.turn_entries) == 1 else _MULTI
        for rid, entry in t.turn_entries.items():
            entry[_OWNER] = None
            self._index[rid].turn_alive[kind] -= 1
        t.turn_entries.clear()

    def _set_turn_index(self, on: bool) -> None:
        """Build (timeshare mode) or drop the heaps keyed by the end of each tenant's last turn."""
        self._turn_index = on
        for t in self._tenants.values():
            self._leave_turn_queue(t)
        for idx in self._index:
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
        if preemptive is not self._by_class:
            self._by_class = preemptive
            for t in self._tenants.values():
                if t.demand:
                    self._unindex(t)
                    self._reindex(t)
        tenants = self._tenants
        if not timeshare and not self._multi:
            holder_ids, holders, running = self._decide_singles(now, preemptive)
        else:
            holder_ids, holders, running = self._decide_general(now, preemptive, timeshare)
            self._start_turns(running, now, timeshare)
        # the tenants that ran in the last decision and do not now end their turn
        in_turn = self._in_turn
        running_set = frozenset(running)
        if len(in_turn) != len(running_set):
            for name in in_turn - running_set:
                t = tenants[name]
                t.turn_started = None
                t.last_run_end = now
                if timeshare and t.demand:
                    self._enter_turn_queue(t)
            in_turn.intersection_update(running_set)
        self._holders = holder_ids

        slice_s = self.config.slice_s
        if timeshare and running:
            remaining = [self._window(tenants[n]) - (now - (tenants[n].turn_started or 0.0)) for n in running]
            slice_s = max(0.001, min(max(remaining), slice_s * 4))
        active = self._active_frozen
        if active is None:
            active = self._active_frozen = frozenset(self._active)
        return Decision(now=now, slice_s=slice_s, running=running_set, waiting=active - running_set, holders=holders)

    def _start_turns(self, running: list[str], now: float, timeshare: bool) -> None:
        """Count the slice; a tenant that did not hold its resources (or whose timeshare turn is over, with
        nobody else waiting for it) starts a new turn."""
        prev = self._holders
        for name in running:
            t = self._tenants[name]
            t.slices += 1
            if t.turn_started is None:
                t.turn_started = now
                self._in_turn.add(name)
                if timeshare:
                    self._leave_turn_queue(t)
            elif not _holds(prev, name, t) or (timeshare and now - t.turn_started >= self._window(t) - _TURN_EPS_S):
                t.turn_started = now

    def _decide_singles(self, now: float, preemptive: bool) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
        """Every active tenant uses one resource: each resource goes to its best tenant, independently.

        On one resource the tenants share the clock, so they rank by vtime: the winner is the top of the
        online or the offline heap, or the holder when it ties with its top (the holder wins ties).
        """
        prev = self._holders
        tenants = self._tenants
        vclock = self._vclock
        resources = self._resources
        in_turn = self._in_turn
        heappop = heapq.heappop
        holder_ids: dict[int, str] = {}
        holders: dict[Resource, str] = {}
        running: list[str] = []
        for rid, idx in self._contended.items():
            vt = idx.vt
            on = vt[_ONLINE * 2 + _SINGLE]  # empty unless preemptive
            while on and on[0][_OWNER] is None:
                heappop(on)
            off = vt[_OFFLINE * 2 + _SINGLE]
            while off and off[0][_OWNER] is None:
                heappop(off)
            if on:
                best = on[0]  # online first
                lowest = off[0][_KEY] if off and off[0][_KEY] < best[_KEY] else best[_KEY]
            else:
                best = off[0]
                lowest = best[_KEY]
            clock = vclock[rid]
            if lowest > clock:
                vclock[rid] = clock = lowest
            name = best[_NAME]
            holder = prev.get(rid)
            if holder is not None and holder != name:
                ht = tenants.get(holder)
                if ht is not None and ht.only == rid and ht.slot == best[_OWNER].slot:
                    held = ht.entries[rid]
                    if held[_KEY] - clock == best[_KEY] - clock:
                        best = held  # tied with the best: the holder wins ties
                        name = holder
            t: _Tenant = best[_OWNER]
            holder_ids[rid] = name
            pair = t.held.get(rid)
            if pair is None:
                pair = t.held[rid] = {resources[rid]: name}
            holders.update(pair)
            running.append(name)
            t.slices += 1
            if t.turn_started is None:
                t.turn_started = now
                in_turn.add(name)
            elif holder != name:
                t.turn_started = now
        return holder_ids, holders, running

    def _decide_general(
        self, now: float, preemptive: bool, timeshare: bool
    ) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
        """Tenants on several resources, or timeshare turns: the exact greedy over the few candidates."""
        tenants = self._tenants
        prev = self._holders
        vclock = self._vclock
        heappop = heapq.heappop
        inf = math.inf

        # 1. Advance the clocks, and collect the few tenants that can win each resource. Single-resource
        #    tenants on one resource share its clock, so they rank by vtime: only a heap top, or the holder
        #    when it ties with the top, can win. A multi-resource tenant can only win a resource if it is
        #    at or ahead of the best single one there.
        local: dict[int, list[_Tenant]] = {}
        multis: dict[str, _Tenant] = {}
        bounds: dict[int, tuple[float, float]] = {}
        """Per resource, the best single tenant's key that an online / offline multi must not exceed."""
        with_multis: list[int] = []
        for rid, idx in self._contended.items():
            vt = idx.vt
            lowest = inf
            for h in vt:
                if h:
                    top = h[0]
                    while top[_OWNER] is None:
                        heappop(h)
                        if not h:
                            break
                        top = h[0]
                    else:
                        if top[_KEY] < lowest:
                            lowest = top[_KEY]
            clock = vclock[rid]
            if lowest > clock:
                vclock[rid] = clock = lowest
            singles: list[_Tenant] = []
            local[rid] = singles
            if timeshare:
                bound = inf
                h = idx.turn[_SINGLE]
                while h and h[0][_OWNER] is None:
                    heappop(h)
                if h:
                    singles.append(h[0][_OWNER])
                    bound = h[0][_KEY]
                if idx.turn[_MULTI]:
                    _take_multis(idx.turn[_MULTI], bound, multis)
                continue
            tops: list[_Entry | None] = [None, None]
            online_top = offline_top = inf
            h = vt[_ONLINE * 2 + _SINGLE]  # empty unless preemptive
            if h:
                tops[_ONLINE] = top = h[0]
                singles.append(top[_OWNER])
                online_top = top[_KEY]
            h = vt[_OFFLINE * 2 + _SINGLE]
            if h:
                tops[_OFFLINE] = top = h[0]
                singles.append(top[_OWNER])
                offline_top = top[_KEY]
            holder = prev.get(rid)
            if holder is not None:
                ht = tenants.get(holder)
                if ht is not None and ht.only == rid:
                    best = tops[ht.slot >> 1]
                    if best is not None and best[_OWNER] is not ht and ht.entries[rid][_KEY] - clock == best[_KEY] - clock:
                        singles.append(ht)  # tied with the top: the holder wins ties
            # an offline multi loses to any online single (preemptive); else to a single ahead of it
            bounds[rid] = (online_top, offline_top if online_top == inf else -inf)
            if vt[_ONLINE * 2 + _MULTI] or vt[_OFFLINE * 2 + _MULTI]:
                with_multis.append(rid)
        if timeshare:
            for name in self._in_turn:
                t = tenants[name]
                if t.only >= 0:
                    local[t.only].append(t)
                elif t.demand:
                    multis[name] = t
        else:
            # A multi-resource tenant can only win if no single one beats it on any of its resources;
            # each is checked once, on the first of its resources.
            for rid in with_multis:
                vt = self._index[rid].vt
                for cls in (_ONLINE, _OFFLINE):
                    bound = bounds[rid][cls]
                    for entry in vt[cls * 2 + _MULTI]:
                        if entry[_KEY] <= bound:
                            m = entry[_OWNER]
                            if m is not None and m.demand_ids[0] == rid:
                                for other, e in m.entries.items():
                                    if e[_KEY] > bounds[other][cls]:
                                        break
                                else:
                                    multis[entry[_NAME]] = m

        # 2. The greedy over every active tenant (best rank first, skipping a tenant one of whose resources
        #    is taken) picks the same winners when run over these candidates only. A resource that no
        #    candidate multi-resource tenant wants goes to its own best candidate.
        holder_ids: dict[int, str] = {}
        holders: dict[Resource, str] = {}
        running: list[str] = []
        resources = self._resources
        contested: set[int] = set()
        for m in multis.values():
            contested.update(m.demand_ids)
        ranked: list[tuple[tuple[float, float, float, str], _Tenant]] = []
        for rid, singles in local.items():
            if rid in contested:
                ranked.extend((self._rank(t, now, preemptive, timeshare), t) for t in singles)
                continue
            if not singles:
                continue
            t = singles[0] if len(singles) == 1 else min(singles, key=lambda c: self._rank(c, now, preemptive, timeshare))
            name = t.spec.name
            holder_ids[rid] = name
            pair = t.held.get(rid)
            if pair is None:
                pair = t.held[rid] = {resources[rid]: name}
            holders.update(pair)
            running.append(name)
        if multis:
            ranked.extend((self._rank(m, now, preemptive, timeshare), m) for m in multis.values())
            ranked.sort(key=_first)
            taken: set[int] = set()
            for _, t in ranked:
                name = t.spec.name
                if not taken.isdisjoint(t.demand_ids):
                    if timeshare:
                        taken.update(t.demand_ids)  # keep its free resources for it: no overtaking in turns
                    continue
                taken.update(t.demand_ids)
                for rid in t.demand_ids:
                    holder_ids[rid] = name
                    holders[resources[rid]] = name
                running.append(name)

        return holder_ids, holders, running

    def _rank(self, t: _Tenant, now: float, preemptive: bool, timeshare: bool) -> tuple[float, float, float, str]:
        """A tenant's place in the greedy order (lower first); the same order as a sort of all would give."""
        name = t.spec.name
        cls = 0.0 if (preemptive and t.spec.priority is Priority.ONLINE) else 1.0
        only = t.only
        prev = self._holders
        held = prev.get(only) == name if only >= 0 else _holds(prev, name, t)
        if timeshare:
            if t.turn_started is None:
                return (cls, 1.0, t.last_run_end, name)
            if held and now - t.turn_started < self._window(t) - _TURN_EPS_S:
                return (cls, 0.0, t.last_run_end, name)
            return (cls, 1.0, now, name)  # its turn is over: behind everyone who waited (round robin)
        vclock = self._vclock
        lag = t.entries[only][_KEY] - vclock[only] if only >= 0 else max(e[_KEY] - vclock[rid] for rid, e in t.entries.items())
        return (cls, lag, 0.0 if held else 1.0, name)

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
