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

Cost. `decide` runs every slice, so it does not walk or sort the tenants. Each resource keeps min-heaps of
the tenants active on it, by kind (tenants that use only this resource, "single", and those that use several,
"multi") and, in preemptive mode only, by priority class. Entries are keyed by virtual time, lazily: a charge
only raises the tenant's value, and an entry whose key lags its value is re-placed when it reaches the top
(a vtime never decreases while its tenant has demand, so a lagging key is a lower bound); dead entries (demand
withdrawn) are dropped when they surface. On one resource the single tenants share the clock, so they rank by
vtime alone: only the heap top, or the holder when it ties with it, can win. A multi-resource tenant can only
win if no single one is ahead of it on any of its resources; only those few enter the greedy, which then picks
exactly what the greedy over every active tenant would. A decision costs O(R log N) for R contended resources
(plus the multi-resource tenants that pass that test), and a charge O(1); only `Decision.waiting`, a set of
every waiting tenant, is O(N) (a copy in C). `stats` and `target_shares` walk all tenants (reporting).
Ties in virtual time that exist only through float rounding of (vtime - clock) may break differently than a
full sort by that difference would; exact ties break as they always did (holder first, then name).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
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
    active: frozenset[str]
    """Every tenant with demand (shared between decisions while demand does not change: no copy per slice)."""
    holders: Mapping[Resource, str]

    @property
    def waiting(self) -> frozenset[str]:
        """Tenants with demand that must not run this slice (frozen). O(tenants): prefer `must_wait(name)`."""
        return self.active - self.running

    def must_wait(self, name: str) -> bool:
        return name in self.active and name not in self.running


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
    seconds_by: Mapping[Resource, float] = field(default_factory=dict)
    """`gpu_seconds` by resource (GPU and domain): what metrics export per GPU."""


# A heap entry is a list, so that entries compare in C: [key, name, seq, owner, value].
# - vtime heaps: `value` is the tenant's vtime on the resource and `key` the vtime when the entry was last
#   placed. A vtime only grows while the tenant has demand, so `key` is a lower bound of `value`: a charge
#   just raises `value` (no heap work), and a top whose key is behind its value is re-placed when it
#   surfaces. A top with key == value is then the true minimum.
# - turn heaps (timeshare): key == value == the end of the tenant's last turn.
# `seq` makes every entry unique; `owner` is the _Tenant, or None once the entry is dead (lazy deletion).
_Entry = list[Any]
_KEY, _NAME, _SEQ, _OWNER, _VALUE = 0, 1, 2, 3, 4
_MULTI, _SINGLE = 0, 1
_ONLINE, _OFFLINE = 0, 1
_TURN_EPS_S = 1e-6
"""A timeshare turn this close to its end is over (slice lengths are sums of floats)."""
_COMPACT_MIN = 64
"""A heap is rebuilt without its dead entries once it is this long and mostly dead."""
_SCAN_MAX = 32
"""Multi-resource heaps up to this long are scanned; longer ones are walked from the root."""
_Rank = tuple[float, float, float, str]


@dataclass(slots=True)
class _Tenant:
    spec: TenantSpec
    weight: int
    vtime: dict[Resource, float] = field(default_factory=dict)
    demand: frozenset[Resource] = frozenset()
    gpu_seconds: float = 0.0
    seconds_by: dict[Resource, float] = field(default_factory=dict)
    slices: int = 0
    last_run_end: float = float("-inf")
    turn_started: float | None = None
    min_run_s: float = 0.0
    """Once it holds a resource, it keeps it this long against tenants of its class (see set_min_run)."""
    activated: int = 0
    """WeightedFairShare._activations when its demand last went from none to some."""
    turn_mark: int = 0
    """WeightedFairShare._activations when its turn began: a tenant activated later is not held off by its min run."""
    window: dict[Resource, float] = field(default_factory=dict)
    """GPU seconds charged per resource within the share window (kept by WeightedFairShare._prune)."""
    removed: bool = False
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

    `vt[slot]` (slot = class * 2 + kind) is keyed by virtual time. Classes are split only in preemptive
    mode (otherwise every tenant is in the offline heaps). `turn[kind]` (timeshare mode only) is keyed by
    the end of the tenant's last turn and holds only tenants that are not in a turn now.
    """

    __slots__ = ("active", "turn", "turn_alive", "vt", "vt_alive")

    def __init__(self) -> None:
        self.vt: tuple[list[_Entry], ...] = ([], [], [], [])
        self.vt_alive = [0, 0, 0, 0]
        self.turn: tuple[list[_Entry], ...] = ([], [])
        self.turn_alive = [0, 0]
        self.active = 0


def _in_min_run(t: _Tenant, rival: _Tenant, now: float) -> bool:
    """The holder `t` keeps its turn against `rival`: within its minimum run, and the rival was already waiting
    when the turn began (a tenant that wakes up takes its share back at the next decision, min runs or not)."""
    started = t.turn_started
    return started is not None and now - started < t.min_run_s - _TURN_EPS_S and rival.activated <= t.turn_mark


def _push(heap: list[_Entry], alive: int, entry: _Entry) -> None:
    """Push; when the heap is mostly dead entries, rebuild it (in place) from the live ones."""
    heapq.heappush(heap, entry)
    if len(heap) > _COMPACT_MIN and len(heap) > 3 * alive:
        heap[:] = [e for e in heap if e[_OWNER] is not None]
        heapq.heapify(heap)


def _settle(heap: list[_Entry]) -> _Entry | None:
    """The live entry with the lowest value (dropping dead tops, re-placing tops whose key lags)."""
    while heap:
        top = heap[0]
        if top[_OWNER] is None:
            heapq.heappop(heap)
        elif top[_KEY] != top[_VALUE]:
            top[_KEY] = top[_VALUE]
            heapq.heapreplace(heap, top)
        else:
            return top
    return None


def _at_most(heap: list[_Entry], bound: float) -> Iterator[_Entry]:
    """The live entries whose value is <= bound, without changing the heap.

    A scan when the heap is short, else a walk down from the root that stops below entries whose key is
    past the bound (their children's keys, and so values, are later still).
    """
    if len(heap) <= _SCAN_MAX:
        for entry in heap:
            if entry[_VALUE] <= bound and entry[_OWNER] is not None:
                yield entry
        return
    n = len(heap)
    stack = [0]
    while stack:
        i = stack.pop()
        entry = heap[i]
        if entry[_KEY] > bound:
            continue
        if entry[_VALUE] <= bound and entry[_OWNER] is not None:
            yield entry
        i = 2 * i + 1
        if i < n:
            stack.append(i)
            if i + 1 < n:
                stack.append(i + 1)


def _first(item: tuple[_Rank, _Tenant]) -> _Rank:
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
        self._activations = 0
        """Counts tenants whose demand went from none to some (min runs do not hold off one that woke in a turn)."""
        """Tenants that run since the last decision (their turn_started is set)."""
        self._multi = 0
        """Active tenants with demand on several resources (none: each resource is decided on its own)."""
        self._turn_index = False
        """Whether the heaps keyed by turn end are kept (timeshare mode only)."""
        self._by_class = self.config.mode is Mode.PREEMPTIVE
        """Whether online tenants have heaps of their own (preemptive mode only)."""
        self._seq = count()
        self._charges: deque[tuple[float, _Tenant, Resource, float]] = deque()
        """Every charge within the share window, oldest first: the measured shares, O(1) per charge."""
        self._window_total: dict[Resource, float] = {}
        self._demand_weight: dict[Resource, int] = {}
        """Sum of the weights of the tenants with demand on each resource (targets without a scan)."""

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
            self._reweigh(t, spec.weight)
            self._reindex(t)
        else:
            t.spec = spec
            self._reweigh(t, spec.weight)

    def _reweigh(self, t: _Tenant, weight: int) -> None:
        for r in t.demand:
            self._demand_weight[r] += weight - t.weight
        t.weight = weight

    def remove(self, name: str) -> None:
        t = self._get(name)
        self._unindex(t)
        for r in t.demand:
            self._demand_weight[r] -= t.weight
        for r, used in t.window.items():  # its charges leave the measured shares now, not when they expire
            self._window_total[r] -= used
        t.window.clear()
        t.removed = True
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
        self._reweigh(self._get(name), validate_weight(weight))

    def set_min_run(self, name: str, seconds: float) -> None:
        """A holder keeps its resource at least this long against tenants of its own class that were already
        waiting when its turn began (a higher class still preempts it, a tenant that wakes during the turn takes
        its share back at the next decision, and it hands over at once when its demand ends). For work whose
        hand-overs cost (queued units time-sliced beside the next holder's, the GPU idle until its first launch):
        fewer, longer turns. Charges are unchanged, so shares converge to the weights as before,
        over longer turns. 0 turns it off; timeshare mode and multi-resource tenants ignore it."""
        if not (0.0 <= seconds <= 10.0):
            raise PolicyError(f"minimum run must be within 0 .. 10 s, got {seconds!r}")
        self._get(name).min_run_s = seconds

    def min_run_left(self, name: str, now: float) -> float:
        """How long the tenant's minimum run still holds it in place (0 when none, or not in a turn)."""
        t = self._tenants.get(name)
        if t is None or not t.min_run_s or t.turn_started is None:
            return 0.0
        return max(0.0, t.turn_started + t.min_run_s - now)

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def contenders(self, resource: Resource) -> int:
        """How many tenants have demand on the resource now (a lease holder alone need not stop early)."""
        rid = self._rids.get(resource)
        return 0 if rid is None else self._index[rid].active

    def weight(self, name: str) -> int:
        return self._get(name).weight

    def priority(self, name: str) -> Priority:
        return self._get(name).spec.priority

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
        dw = self._demand_weight
        for r in t.demand:
            dw[r] -= t.weight
        for r in new:
            dw[r] = dw.get(r, 0) + t.weight
        if new and not t.demand:
            self._activations += 1
            t.activated = self._activations
        t.demand = new
        self._reindex(t)
        if new:
            if name not in self._active:
                self._active.add(name)
                self._active_frozen = None
        elif name in self._active:
            self._active.discard(name)
            self._active_frozen = None

    def level(self, resource: Resource) -> None:
        """Start weighted sharing of `resource` with nobody owed: every tenant wanting it gets the same virtual time
        (the highest among them). For the moment it becomes saturated after a stretch in which every tenant ran as
        much as it wanted: nobody was deprived then, so nobody is owed catch-up time now."""
        members = [t for t in self._tenants.values() if resource in t.demand]
        if len(members) < 2:
            return
        top = max(t.vtime.get(resource, 0.0) for t in members)
        for t in members:
            if t.vtime.get(resource) != top:
                self._unindex(t)
                t.vtime[resource] = top
                self._reindex(t)

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
            entry = t.entries.get(self._rids[resource])
            if entry is not None:
                entry[_VALUE] = v  # its heap place is fixed when it reaches the top
        t.gpu_seconds += gpu_seconds
        t.seconds_by[resource] = t.seconds_by.get(resource, 0.0) + gpu_seconds
        t.window[resource] = t.window.get(resource, 0.0) + gpu_seconds
        self._window_total[resource] = self._window_total.get(resource, 0.0) + gpu_seconds
        self._charges.append((now, t, resource, gpu_seconds))
        self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.config.share_window_s
        q = self._charges
        while q and q[0][0] < horizon:
            _, t, r, secs = q.popleft()
            if not t.removed:
                t.window[r] -= secs
                self._window_total[r] -= secs

    def _clock(self, rid: int) -> float:
        """The resource's virtual clock: the lowest vtime among tenants active on it (monotonic)."""
        clock = self._vclock[rid]
        idx = self._contended.get(rid)
        if idx is not None:
            lowest = min((top[_KEY] for top in map(_settle, idx.vt) if top is not None), default=clock)
            if lowest > clock:
                clock = lowest
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
            v = t.vtime[r]
            entry = [v, name, next(self._seq), t, v]
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
            entry = [t.last_run_end, t.spec.name, next(self._seq), t, t.last_run_end]
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

    def _set_by_class(self, on: bool) -> None:
        """Split (preemptive mode) or merge the online and offline heaps."""
        self._by_class = on
        for t in self._tenants.values():
            if t.demand:
                self._unindex(t)
                self._reindex(t)

    # --- decisions --------------------------------------------------------------------------------
    def decide(self, now: float) -> Decision:
        mode = self.config.mode
        timeshare = mode is Mode.TIMESHARE
        if timeshare is not self._turn_index:
            self._set_turn_index(timeshare)
        preemptive = mode is Mode.PREEMPTIVE
        if preemptive is not self._by_class:
            self._set_by_class(preemptive)
        tenants = self._tenants
        if timeshare:
            holder_ids, holders, running = self._decide_turns(now)
        elif not self._multi and not preemptive:
            holder_ids, holders, running = self._decide_plain(now)
        else:
            holder_ids, holders, running = self._decide_vtime(now, preemptive)
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
        return Decision(now=now, slice_s=slice_s, running=running_set, active=active, holders=holders)

    def _decide_plain(self, now: float) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
        """`_decide_vtime` for its common case, inlined: one class (not preemptive), every tenant on one resource.

        Every live entry is then in the offline single-resource heap; a contended resource has at least one.
        """
        prev = self._holders
        tenants = self._tenants
        vclock = self._vclock
        heappop = heapq.heappop
        heapreplace = heapq.heapreplace
        holder_ids: dict[int, str] = {}
        holders: dict[Resource, str] = {}
        running: list[str] = []
        for rid, idx in self._contended.items():
            h = idx.vt[_OFFLINE * 2 + _SINGLE]
            top = h[0]
            while top[_OWNER] is None or top[_KEY] != top[_VALUE]:  # dead, or its key lags its vtime
                if top[_OWNER] is None:
                    heappop(h)
                else:
                    top[_KEY] = top[_VALUE]
                    heapreplace(h, top)
                top = h[0]
            key = top[_KEY]
            clock = vclock[rid]
            if key > clock:
                vclock[rid] = clock = key
            t: _Tenant = top[_OWNER]
            name = top[_NAME]
            holder = prev.get(rid)
            if holder is not None and holder != name:
                ht = tenants.get(holder)
                if ht is not None and ht.only == rid and (
                    ht.entries[rid][_VALUE] - clock == key - clock  # tied: the holder wins ties
                    or _in_min_run(ht, t, now)
                ):
                    t = ht
                    name = holder
            self._win(t, rid, name, holder, now, holder_ids, holders, running)
        return holder_ids, holders, running

    def _decide_vtime(self, now: float, preemptive: bool) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
        """Shared, preemptive and tidal modes: lowest lag first.

        On one resource, single-resource tenants share the clock and so rank by vtime: the best one is the
        top of its class's heap, or the holder when it ties with that top (the holder wins ties). A
        multi-resource tenant can only win if no single one beats it on any of its resources; when such
        tenants exist, the greedy (best rank first, skipping a tenant one of whose resources is taken)
        runs over them and the best single tenants of their resources, which picks the same winners as
        the greedy over every active tenant. Every other resource goes to its best single tenant.
        """
        prev = self._holders
        tenants = self._tenants
        vclock = self._vclock
        inf = math.inf
        multi = self._multi > 0
        holder_ids: dict[int, str] = {}
        holders: dict[Resource, str] = {}
        running: list[str] = []
        best: dict[int, _Tenant] = {}
        bounds: dict[int, tuple[float, float]] = {}
        with_multis: list[int] = []
        for rid, idx in self._contended.items():
            vt = idx.vt
            on = vt[_ONLINE * 2 + _SINGLE]
            off = vt[_OFFLINE * 2 + _SINGLE]
            on_top = _settle(on) if on else None
            off_top = _settle(off) if off else None
            lowest = inf
            if multi:
                for h in (vt[_ONLINE * 2 + _MULTI], vt[_OFFLINE * 2 + _MULTI]):
                    if h:
                        top = _settle(h)
                        if top is not None:
                            if top[_KEY] < lowest:
                                lowest = top[_KEY]
                            if not with_multis or with_multis[-1] != rid:
                                with_multis.append(rid)
            top = on_top if on_top is not None else off_top  # online first
            if off_top is not None and off_top[_KEY] < lowest:
                lowest = off_top[_KEY]
            if on_top is not None and on_top[_KEY] < lowest:
                lowest = on_top[_KEY]
            clock = vclock[rid]
            if lowest > clock:
                vclock[rid] = clock = lowest
            if multi:
                online_bound = inf if on_top is None else on_top[_KEY]
                offline_bound = (inf if off_top is None else off_top[_KEY]) if on_top is None else -inf
                bounds[rid] = (online_bound, offline_bound)
            if top is None:
                continue
            holder = prev.get(rid)
            if holder is not None and holder != top[_NAME]:
                ht = tenants.get(holder)
                if ht is not None and ht.only == rid and ht.slot == top[_OWNER].slot:
                    mine = ht.entries[rid]
                    if mine[_VALUE] - clock == top[_KEY] - clock or _in_min_run(ht, top[_OWNER], now):
                        top = mine  # tied (the holder wins ties), or within its minimum run
            if multi:
                best[rid] = top[_OWNER]
                continue
            # no multi-resource tenant anywhere: the best single one runs
            t = top[_OWNER]
            self._win(t, rid, t.spec.name, holder, now, holder_ids, holders, running)
        if not multi:
            return holder_ids, holders, running

        cands: dict[str, _Tenant] = {}
        for rid in with_multis:
            vt = self._index[rid].vt
            for cls in (_ONLINE, _OFFLINE):
                heap = vt[cls * 2 + _MULTI]
                if heap:
                    for entry in _at_most(heap, bounds[rid][cls]):
                        m = entry[_OWNER]
                        if m.demand_ids[0] == rid and all(
                            e[_VALUE] <= bounds[other][cls] for other, e in m.entries.items()
                        ):
                            cands[entry[_NAME]] = m

        if cands:
            contested: set[int] = set()
            for m in cands.values():
                contested.update(m.demand_ids)
            ranked = [(self._rank(m, now, preemptive, False), m) for m in cands.values()]
            for rid in contested:
                t = best.pop(rid, None)
                if t is not None:
                    ranked.append((self._rank(t, now, preemptive, False), t))
            ranked.sort(key=_first)
            taken: set[int] = set()
            for _, t in ranked:
                if taken.isdisjoint(t.demand_ids):
                    taken.update(t.demand_ids)
                    self._run(t, now, holder_ids, holders, running)
        self._run_singles(best, now, holder_ids, holders, running)
        return holder_ids, holders, running

    def _run_singles(
        self, best: Mapping[int, _Tenant], now: float,
        holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
    ) -> None:
        """Hand each resource to its single-resource winner."""
        prev = self._holders
        for rid, t in best.items():
            self._win(t, rid, t.spec.name, prev.get(rid), now, holder_ids, holders, running)

    def _win(
        self, t: _Tenant, rid: int, name: str, held_by: str | None, now: float,
        holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
    ) -> None:
        """Hand resource `rid` to its single-resource winner `t`; count the slice; start a turn when it was not in
        one, or a new one when the resource was someone else's (`held_by`)."""
        holder_ids[rid] = name
        pair = t.held.get(rid)
        if pair is None:
            pair = t.held[rid] = {self._resources[rid]: name}
        holders.update(pair)
        running.append(name)
        t.slices += 1
        if t.turn_started is None:
            t.turn_started, t.turn_mark = now, self._activations
            self._in_turn.add(name)
        elif held_by != name:
            t.turn_started, t.turn_mark = now, self._activations

    def _run(
        self, t: _Tenant, now: float,
        holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
    ) -> None:
        """Hand the tenant all its resources; count the slice; start a turn when it did not hold them."""
        name = t.spec.name
        for rid in t.demand_ids:
            holder_ids[rid] = name
            holders[self._resources[rid]] = name
        running.append(name)
        t.slices += 1
        if t.turn_started is None:
            t.turn_started, t.turn_mark = now, self._activations
            self._in_turn.add(name)
            if self._turn_index:
                self._leave_turn_queue(t)
        elif not _holds(self._holders, name, t) or (
            self._turn_index and now - t.turn_started >= self._window(t) - _TURN_EPS_S
        ):
            t.turn_started, t.turn_mark = now, self._activations  # a new turn (in timeshare: nobody else wanted its resources)

    def _decide_turns(self, now: float) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
        """Timeshare: the tenant in its turn keeps its resources until its window is over, then the one
        that waited longest (round robin). The greedy runs over the tenants in a turn, the longest-waiting
        single tenant of each resource and the multi-resource tenants that waited at least as long. A
        multi-resource tenant that is blocked keeps its free resources (no overtaking in turns)."""
        tenants = self._tenants
        vclock = self._vclock
        inf = math.inf
        singles: dict[int, _Tenant] = {}
        cands: dict[str, _Tenant] = {}
        for rid, idx in self._contended.items():
            lowest = inf
            for h in idx.vt:  # the clocks move in every mode
                if h:
                    top = _settle(h)
                    if top is not None and top[_KEY] < lowest:
                        lowest = top[_KEY]
            if lowest > vclock[rid]:
                vclock[rid] = lowest
            bound = inf
            single_top = _settle(idx.turn[_SINGLE]) if idx.turn[_SINGLE] else None
            if single_top is not None:
                singles[rid] = single_top[_OWNER]
                bound = single_top[_KEY]
            if idx.turn[_MULTI]:
                for entry in _at_most(idx.turn[_MULTI], bound):
                    cands[entry[_NAME]] = entry[_OWNER]
        for t in singles.values():
            cands[t.spec.name] = t
        for name in self._in_turn:
            t = tenants[name]
            if t.demand:
                cands[name] = t
        ranked = sorted(((self._rank(t, now, False, True), t) for t in cands.values()), key=_first)
        holder_ids: dict[int, str] = {}
        holders: dict[Resource, str] = {}
        running: list[str] = []
        taken: set[int] = set()
        for _, t in ranked:
            if taken.isdisjoint(t.demand_ids):
                taken.update(t.demand_ids)
                self._run(t, now, holder_ids, holders, running)
            elif t.only < 0:
                taken.update(t.demand_ids)  # blocked: keeps its free resources for itself
        return holder_ids, holders, running

    def _rank(self, t: _Tenant, now: float, preemptive: bool, timeshare: bool) -> _Rank:
        """A tenant's place in the greedy order (lower first)."""
        name = t.spec.name
        cls = 0.0 if (preemptive and t.spec.priority is Priority.ONLINE) else 1.0
        held = _holds(self._holders, name, t)
        if timeshare:
            if t.turn_started is None:
                return (cls, 1.0, t.last_run_end, name)
            if held and now - t.turn_started < self._window(t) - _TURN_EPS_S:
                return (cls, 0.0, t.last_run_end, name)
            return (cls, 1.0, now, name)  # its turn is over: behind everyone who waited (round robin)
        vclock = self._vclock
        lag = max(e[_VALUE] - vclock[rid] for rid, e in t.entries.items())
        return (cls, lag, 0.0 if held else 1.0, name)

    def _window(self, t: _Tenant) -> float:
        return self.config.timeshare_window_s * t.weight / DEFAULT_WEIGHT

    # --- reporting --------------------------------------------------------------------------------
    def target_shares(self, names: Iterable[str] | None = None) -> dict[str, dict[Resource, float]]:
        """Weight share of each resource among tenants active on it (work-conserving targets), for every
        tenant or for `names`.

        An idle tenant's target is the share it would get on waking, so `tenants` shows what it is owed.
        """
        weights = self._demand_weight
        out: dict[str, dict[Resource, float]] = {}
        for n in self._tenants if names is None else names:
            t = self._tenants[n]
            resources = t.demand or frozenset(r for r in t.vtime)
            out[n] = {
                r: t.weight / (weights.get(r, 0) + (0 if r in t.demand else t.weight))
                for r in resources
            }
        return out

    def stats(self, now: float, names: Iterable[str] | None = None) -> list[TenantStats]:
        """Every tenant's stats, or those of `names` only (cheap: a tenant's own sums, kept as charges come)."""
        self._prune(now)
        wanted = sorted(self._tenants) if names is None else sorted(names)
        targets = self.target_shares(wanted)
        totals = self._window_total
        out = []
        for n in wanted:
            t = self._tenants[n]
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
                )
            )
        return out

    def vtimes(self) -> Mapping[str, Mapping[Resource, float]]:
        return {n: dict(t.vtime) for n, t in self._tenants.items()}
