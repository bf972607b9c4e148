"""The fair share's values (its config, its decision, a tenant's stats), its state (`Book`: tenants, per-resource
heaps and virtual clocks, holders, charges) and the index upkeep every change goes through."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import count

from unisched.policy.fairshare.heaps import KEY, MULTI, OFFLINE, ONLINE, OWNER, SINGLE, Entry, Index, push, settle
from unisched.policy.model import (
    DEFAULT_WEIGHT,
    ChargeKind,
    Mode,
    PolicyError,
    Priority,
    Resource,
    TenantSpec,
)

__all__ = [
    "Book", "Decision", "FairShareConfig", "Tenant", "TenantStats", "enter_turn_queue", "get", "leave_turn_queue",
    "prune", "reindex", "resource_id", "reweigh", "set_by_class", "set_turn_index", "turn_window", "unindex",
    "virtual_clock",
]


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
    charged_as: Mapping[tuple[Resource, ChargeKind], float] = field(default_factory=dict)
    """Of `seconds_by`, the charges whose caller said how they came (the rule and source: the engine's always do)."""


# A heap entry is a list, so that entries compare in C: [key, name, seq, owner, value].

@dataclass(slots=True)
class Tenant:
    spec: TenantSpec
    weight: int
    vtime: dict[Resource, float] = field(default_factory=dict)
    demand: frozenset[Resource] = frozenset()
    gpu_seconds: float = 0.0
    seconds_by: dict[Resource, float] = field(default_factory=dict)
    charged_as: dict[tuple[Resource, ChargeKind], float] = field(default_factory=dict)
    slices: int = 0
    last_run_end: float = float("-inf")
    turn_started: float | None = None
    min_run_s: float = 0.0
    """Once it holds a resource, it keeps it this long against tenants of its class (see set_min_run)."""
    activated: int = 0
    """Book.activations when its demand last went from none to some."""
    turn_mark: int = 0
    """Book.activations when its turn began: a tenant activated later is not held off by its min run."""
    window: dict[Resource, float] = field(default_factory=dict)
    """GPU seconds charged per resource within the share window (kept by book.prune)."""
    removed: bool = False
    # Index bookkeeping. Resources are numbered (book.rid) so that the hot path hashes ints,
    # not Resource dataclasses (whose __hash__ is Python code).
    demand_ids: tuple[int, ...] = ()
    only: int = -1
    """The resource id of a single-resource tenant; -1 for idle and multi-resource tenants."""
    slot: int = 0
    """Which vtime heap of each resource holds the tenant: priority class * 2 + kind."""
    entries: dict[int, Entry] = field(default_factory=dict)
    turn_entries: dict[int, Entry] = field(default_factory=dict)
    held: dict[int, dict[Resource, str]] = field(default_factory=dict)
    """{resource: name} per resource id, merged into Decision.holders without hashing the Resource again."""



@dataclass
class Book:
    """The fair share's mutable state, passed to the functions that keep its indices and make its decisions."""

    config: FairShareConfig
    tenants: dict[str, Tenant] = field(default_factory=dict)
    # resources, numbered in order of first use
    rids: dict[Resource, int] = field(default_factory=dict)
    resources: list[Resource] = field(default_factory=list)
    index: list[Index] = field(default_factory=list)
    vclock: list[float] = field(default_factory=list)
    contended: dict[int, Index] = field(default_factory=dict)
    """Resources with at least one active tenant: the ones a decision hands out."""
    holders: dict[int, str] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    active_frozen: frozenset[str] | None = frozenset()
    in_turn: set[str] = field(default_factory=set)
    """Tenants that run since the last decision (their turn_started is set)."""
    activations: int = 0
    """Counts tenants whose demand went from none to some (min runs do not hold off one that woke in a turn)."""
    multi: int = 0
    """Active tenants with demand on several resources (none: each resource is decided on its own)."""
    turn_index: bool = False
    """Whether the heaps keyed by turn end are kept (timeshare mode only)."""
    by_class: bool = False
    """Whether online tenants have heaps of their own (preemptive mode only)."""
    seq: Iterator[int] = field(default_factory=count)
    charges: deque[tuple[float, Tenant, Resource, float]] = field(default_factory=deque)
    """Every charge within the share window, oldest first: the measured shares, O(1) per charge."""
    window_total: dict[Resource, float] = field(default_factory=dict)
    demand_weight: dict[Resource, int] = field(default_factory=dict)
    """Sum of the weights of the tenants with demand on each resource (targets without a scan)."""

    def __post_init__(self) -> None:
        self.by_class = self.config.mode is Mode.PREEMPTIVE

def resource_id(b: Book, r: Resource) -> int:
    rid = b.rids.get(r)
    if rid is None:
        rid = b.rids[r] = len(b.resources)
        b.resources.append(r)
        b.index.append(Index())
        b.vclock.append(0.0)
    return rid


def reweigh(b: Book, t: Tenant, weight: int) -> None:
    for r in t.demand:
        b.demand_weight[r] += weight - t.weight
    t.weight = weight


def get(b: Book, name: str) -> Tenant:
    try:
        return b.tenants[name]
    except KeyError:
        raise PolicyError(f"unknown tenant {name!r}") from None


def prune(b: Book, now: float) -> None:
    horizon = now - b.config.share_window_s
    q = b.charges
    while q and q[0][0] < horizon:
        _, t, r, secs = q.popleft()
        if not t.removed:
            t.window[r] -= secs
            b.window_total[r] -= secs


def virtual_clock(b: Book, rid: int) -> float:
    """The resource's virtual clock: the lowest vtime among tenants active on it (monotonic)."""
    clock = b.vclock[rid]
    idx = b.contended.get(rid)
    if idx is not None:
        lowest = min((top[KEY] for top in map(settle, idx.vt) if top is not None), default=clock)
        if lowest > clock:
            clock = lowest
    b.vclock[rid] = clock
    return clock


def reindex(b: Book, t: Tenant) -> None:
    """Enter an unindexed tenant into the heaps of every resource it has demand on."""
    demand = t.demand
    ids = tuple(resource_id(b, r) for r in demand)
    t.demand_ids = ids
    if not ids:
        t.only = -1
        return
    kind = SINGLE if len(ids) == 1 else MULTI
    t.only = ids[0] if kind == SINGLE else -1
    online = b.by_class and t.spec.priority is Priority.ONLINE
    t.slot = slot = (ONLINE if online else OFFLINE) * 2 + kind
    if kind == MULTI:
        b.multi += 1
    name = t.spec.name
    for r, rid in zip(demand, ids, strict=True):
        idx = b.index[rid]
        v = t.vtime[r]
        entry = [v, name, next(b.seq), t, v]
        t.entries[rid] = entry
        idx.vt_alive[slot] += 1
        push(idx.vt[slot], idx.vt_alive[slot], entry)
        idx.active += 1
        if idx.active == 1:
            b.contended[rid] = idx
    if b.turn_index and t.turn_started is None:
        enter_turn_queue(b, t)


def unindex(b: Book, t: Tenant) -> None:
    if len(t.entries) > 1:
        b.multi -= 1
    for rid, entry in t.entries.items():
        entry[OWNER] = None
        idx = b.index[rid]
        idx.vt_alive[t.slot] -= 1
        idx.active -= 1
        if idx.active == 0:
            del b.contended[rid]
    t.entries.clear()
    leave_turn_queue(b, t)


def enter_turn_queue(b: Book, t: Tenant) -> None:
    kind = SINGLE if len(t.demand_ids) == 1 else MULTI
    for rid in t.demand_ids:
        idx = b.index[rid]
        entry = [t.last_run_end, t.spec.name, next(b.seq), t, t.last_run_end]
        t.turn_entries[rid] = entry
        idx.turn_alive[kind] += 1
        push(idx.turn[kind], idx.turn_alive[kind], entry)


def leave_turn_queue(b: Book, t: Tenant) -> None:
    if not t.turn_entries:
        return
    kind = SINGLE if len(t.turn_entries) == 1 else MULTI
    for rid, entry in t.turn_entries.items():
        entry[OWNER] = None
        b.index[rid].turn_alive[kind] -= 1
    t.turn_entries.clear()


def set_turn_index(b: Book, on: bool) -> None:
    """Build (timeshare mode) or drop the heaps keyed by the end of each tenant's last turn."""
    b.turn_index = on
    for t in b.tenants.values():
        leave_turn_queue(b, t)
    for idx in b.index:
        idx.turn = ([], [])
        idx.turn_alive = [0, 0]
    if on:
        for t in b.tenants.values():
            if t.demand and t.turn_started is None:
                enter_turn_queue(b, t)


def set_by_class(b: Book, on: bool) -> None:
    """Split (preemptive mode) or merge the online and offline heaps."""
    b.by_class = on
    for t in b.tenants.values():
        if t.demand:
            unindex(b, t)
            reindex(b, t)


def turn_window(b: Book, t: Tenant) -> float:
    return b.config.timeshare_window_s * t.weight / DEFAULT_WEIGHT
