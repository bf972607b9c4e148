"""The fair share's decision: which runnable tenant holds each contended resource until the next one (lowest lag
first in shared, preemptive and tidal modes; round robin by turn end in timeshare mode)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from unisched.policy.fairshare.book import (
    Book,
    Decision,
    Tenant,
    enter_turn_queue,
    leave_turn_queue,
    set_by_class,
    set_turn_index,
    turn_window,
)
from unisched.policy.fairshare.heaps import KEY, MULTI, NAME, OFFLINE, ONLINE, OWNER, SINGLE, VALUE, at_most, settle
from unisched.policy.model import Mode, Priority, Resource

__all__ = ["TURN_EPS_S", "decide"]

TURN_EPS_S = 1e-6
"""A timeshare turn this close to its end is over (slice lengths are sums of floats)."""
_Rank = tuple[float, float, float, str]


def _in_min_run(t: Tenant, rival: Tenant, now: float) -> bool:
    """The holder `t` keeps its turn against `rival`: within its minimum run, and the rival was already waiting
    when the turn began (a tenant that wakes up takes its share back at the next decision, min runs or not)."""
    started = t.turn_started
    return started is not None and now - started < t.min_run_s - TURN_EPS_S and rival.activated <= t.turn_mark



def _first(item: tuple[_Rank, Tenant]) -> _Rank:
    return item[0]


def _holds(holders: Mapping[int, str], name: str, t: Tenant) -> bool:
    """Whether the tenant held one of the resources it has demand on."""
    if t.only >= 0:
        return holders.get(t.only) == name
    return any(holders.get(i) == name for i in t.demand_ids)



def decide(b: Book, now: float) -> Decision:
    mode = b.config.mode
    timeshare = mode is Mode.TIMESHARE
    if timeshare is not b.turn_index:
        set_turn_index(b, timeshare)
    preemptive = mode is Mode.PREEMPTIVE
    if preemptive is not b.by_class:
        set_by_class(b, preemptive)
    tenants = b.tenants
    if timeshare:
        holder_ids, holders, running = _decide_turns(b, now)
    elif not b.multi and not preemptive:
        holder_ids, holders, running = _decide_plain(b, now)
    else:
        holder_ids, holders, running = _decide_vtime(b, now, preemptive)
    # the tenants that ran in the last decision and do not now end their turn
    in_turn = b.in_turn
    running_set = frozenset(running)
    if len(in_turn) != len(running_set):
        for name in in_turn - running_set:
            t = tenants[name]
            t.turn_started = None
            t.last_run_end = now
            if timeshare and t.demand:
                enter_turn_queue(b, t)
        in_turn.intersection_update(running_set)
    b.holders = holder_ids

    slice_s = b.config.slice_s
    if timeshare and running:
        remaining = [turn_window(b, tenants[n]) - (now - (tenants[n].turn_started or 0.0)) for n in running]
        slice_s = max(0.001, min(max(remaining), slice_s * 4))
    active = b.active_frozen
    if active is None:
        active = b.active_frozen = frozenset(b.active)
    return Decision(now=now, slice_s=slice_s, running=running_set, active=active, holders=holders)


def _decide_plain(b: Book, now: float) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
    """`_decide_vtime` for its common case, inlined: one class (not preemptive), every tenant on one resource.

    Every live entry is then in the offline single-resource heap; a contended resource has at least one.
    """
    prev = b.holders
    tenants = b.tenants
    vclock = b.vclock
    heappop = heapq.heappop
    heapreplace = heapq.heapreplace
    holder_ids: dict[int, str] = {}
    holders: dict[Resource, str] = {}
    running: list[str] = []
    for rid, idx in b.contended.items():
        h = idx.vt[OFFLINE * 2 + SINGLE]
        top = h[0]
        while top[OWNER] is None or top[KEY] != top[VALUE]:  # dead, or its key lags its vtime
            if top[OWNER] is None:
                heappop(h)
            else:
                top[KEY] = top[VALUE]
                heapreplace(h, top)
            top = h[0]
        key = top[KEY]
        clock = vclock[rid]
        if key > clock:
            vclock[rid] = clock = key
        t: Tenant = top[OWNER]
        name = top[NAME]
        holder = prev.get(rid)
        if holder is not None and holder != name:
            ht = tenants.get(holder)
            if ht is not None and ht.only == rid and (
                ht.entries[rid][VALUE] - clock == key - clock  # tied: the holder wins ties
                or _in_min_run(ht, t, now)
            ):
                t = ht
                name = holder
        _win(b, t, rid, name, holder, now, holder_ids, holders, running)
    return holder_ids, holders, running


def _decide_vtime(b: Book, now: float, preemptive: bool) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
    """Shared, preemptive and tidal modes: lowest lag first.

    On one resource, single-resource tenants share the clock and so rank by vtime: the best one is the
    top of its class's heap, or the holder when it ties with that top (the holder wins ties). A
    multi-resource tenant can only win if no single one beats it on any of its resources; when such
    tenants exist, the greedy (best rank first, skipping a tenant one of whose resources is taken)
    runs over them and the best single tenants of their resources, which picks the same winners as
    the greedy over every active tenant. Every other resource goes to its best single tenant.
    """
    prev = b.holders
    tenants = b.tenants
    vclock = b.vclock
    inf = math.inf
    multi = b.multi > 0
    holder_ids: dict[int, str] = {}
    holders: dict[Resource, str] = {}
    running: list[str] = []
    best: dict[int, Tenant] = {}
    bounds: dict[int, tuple[float, float]] = {}
    with_multis: list[int] = []
    for rid, idx in b.contended.items():
        vt = idx.vt
        on = vt[ONLINE * 2 + SINGLE]
        off = vt[OFFLINE * 2 + SINGLE]
        on_top = settle(on) if on else None
        off_top = settle(off) if off else None
        lowest = inf
        if multi:
            for h in (vt[ONLINE * 2 + MULTI], vt[OFFLINE * 2 + MULTI]):
                if h:
                    top = settle(h)
                    if top is not None:
                        if top[KEY] < lowest:
                            lowest = top[KEY]
                        if not with_multis or with_multis[-1] != rid:
                            with_multis.append(rid)
        top = on_top if on_top is not None else off_top  # online first
        if off_top is not None and off_top[KEY] < lowest:
            lowest = off_top[KEY]
        if on_top is not None and on_top[KEY] < lowest:
            lowest = on_top[KEY]
        clock = vclock[rid]
        if lowest > clock:
            vclock[rid] = clock = lowest
        if multi:
            online_bound = inf if on_top is None else on_top[KEY]
            offline_bound = (inf if off_top is None else off_top[KEY]) if on_top is None else -inf
            bounds[rid] = (online_bound, offline_bound)
        if top is None:
            continue
        holder = prev.get(rid)
        if holder is not None and holder != top[NAME]:
            ht = tenants.get(holder)
            if ht is not None and ht.only == rid and ht.slot == top[OWNER].slot:
                mine = ht.entries[rid]
                if mine[VALUE] - clock == top[KEY] - clock or _in_min_run(ht, top[OWNER], now):
                    top = mine  # tied (the holder wins ties), or within its minimum run
        if multi:
            best[rid] = top[OWNER]
            continue
        # no multi-resource tenant anywhere: the best single one runs
        t = top[OWNER]
        _win(b, t, rid, t.spec.name, holder, now, holder_ids, holders, running)
    if multi:
        _award_with_multis(b, best, bounds, with_multis, now, preemptive, holder_ids, holders, running)
    return holder_ids, holders, running


def _multi_candidates(b: Book, with_multis: list[int], bounds: Mapping[int, tuple[float, float]]) -> dict[str, Tenant]:
    """The multi-resource tenants no single-resource one beats on any of their resources: the only ones that can
    win (each found once, from the first of its resources)."""
    cands: dict[str, Tenant] = {}
    for rid in with_multis:
        vt = b.index[rid].vt
        for cls in (ONLINE, OFFLINE):
            heap = vt[cls * 2 + MULTI]
            if heap:
                for entry in at_most(heap, bounds[rid][cls]):
                    m = entry[OWNER]
                    if m.demand_ids[0] == rid and all(
                        e[VALUE] <= bounds[other][cls] for other, e in m.entries.items()
                    ):
                        cands[entry[NAME]] = m
    return cands


def _award_with_multis(
    b: Book, best: dict[int, Tenant], bounds: Mapping[int, tuple[float, float]], with_multis: list[int], now: float,
    preemptive: bool, holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
) -> None:
    """The greedy (best rank first, skipping a tenant one of whose resources is taken) over the multi-resource
    candidates and the best single tenants of their resources; every other resource to its best single tenant."""
    cands = _multi_candidates(b, with_multis, bounds)
    if cands:
        contested: set[int] = set()
        for m in cands.values():
            contested.update(m.demand_ids)
        ranked = [(_rank(b, m, now, preemptive, False), m) for m in cands.values()]
        for rid in contested:
            t = best.pop(rid, None)
            if t is not None:
                ranked.append((_rank(b, t, now, preemptive, False), t))
        ranked.sort(key=_first)
        taken: set[int] = set()
        for _, t in ranked:
            if taken.isdisjoint(t.demand_ids):
                taken.update(t.demand_ids)
                _run(b, t, now, holder_ids, holders, running)
    _run_singles(b, best, now, holder_ids, holders, running)


def _run_singles(
    b: Book, best: Mapping[int, Tenant], now: float,
    holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
) -> None:
    """Hand each resource to its single-resource winner."""
    prev = b.holders
    for rid, t in best.items():
        _win(b, t, rid, t.spec.name, prev.get(rid), now, holder_ids, holders, running)


def _win(
    b: Book, t: Tenant, rid: int, name: str, held_by: str | None, now: float,
    holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
) -> None:
    """Hand resource `rid` to its single-resource winner `t`; a new turn when it was someone else's (`held_by`)."""
    holder_ids[rid] = name
    pair = t.held.get(rid)
    if pair is None:
        pair = t.held[rid] = {b.resources[rid]: name}
    holders.update(pair)
    _count_run(b, t, name, now, running, kept=held_by == name)


def _run(
    b: Book, t: Tenant, now: float,
    holder_ids: dict[int, str], holders: dict[Resource, str], running: list[str],
) -> None:
    """Hand the tenant all its resources; a new turn when it did not hold them (in timeshare: also when its window
    is over and nobody else wanted its resources)."""
    name = t.spec.name
    for rid in t.demand_ids:
        holder_ids[rid] = name
        holders[b.resources[rid]] = name
    started = t.turn_started
    kept = started is None or (_holds(b.holders, name, t) and not (
        b.turn_index and now - started >= turn_window(b, t) - TURN_EPS_S))
    _count_run(b, t, name, now, running, kept)


def _count_run(b: Book, t: Tenant, name: str, now: float, running: list[str], kept: bool) -> None:
    """The one bookkeeping of a winner: count its slice; start its turn when it was not in one, or a new turn when
    it did not keep what it held (`kept`)."""
    running.append(name)
    t.slices += 1
    if t.turn_started is None:
        t.turn_started, t.turn_mark = now, b.activations
        b.in_turn.add(name)
        if b.turn_index:
            leave_turn_queue(b, t)
    elif not kept:
        t.turn_started, t.turn_mark = now, b.activations


def _decide_turns(b: Book, now: float) -> tuple[dict[int, str], dict[Resource, str], list[str]]:
    """Timeshare: the tenant in its turn keeps its resources until its window is over, then the one
    that waited longest (round robin). The greedy runs over the tenants in a turn, the longest-waiting
    single tenant of each resource and the multi-resource tenants that waited at least as long. A
    multi-resource tenant that is blocked keeps its free resources (no overtaking in turns)."""
    tenants = b.tenants
    vclock = b.vclock
    inf = math.inf
    singles: dict[int, Tenant] = {}
    cands: dict[str, Tenant] = {}
    for rid, idx in b.contended.items():
        lowest = inf
        for h in idx.vt:  # the clocks move in every mode
            if h:
                top = settle(h)
                if top is not None and top[KEY] < lowest:
                    lowest = top[KEY]
        if lowest > vclock[rid]:
            vclock[rid] = lowest
        bound = inf
        single_top = settle(idx.turn[SINGLE]) if idx.turn[SINGLE] else None
        if single_top is not None:
            singles[rid] = single_top[OWNER]
            bound = single_top[KEY]
        if idx.turn[MULTI]:
            for entry in at_most(idx.turn[MULTI], bound):
                cands[entry[NAME]] = entry[OWNER]
    for t in singles.values():
        cands[t.spec.name] = t
    for name in b.in_turn:
        t = tenants[name]
        if t.demand:
            cands[name] = t
    ranked = sorted(((_rank(b, t, now, False, True), t) for t in cands.values()), key=_first)
    holder_ids: dict[int, str] = {}
    holders: dict[Resource, str] = {}
    running: list[str] = []
    taken: set[int] = set()
    for _, t in ranked:
        if taken.isdisjoint(t.demand_ids):
            taken.update(t.demand_ids)
            _run(b, t, now, holder_ids, holders, running)
        elif t.only < 0:
            taken.update(t.demand_ids)  # blocked: keeps its free resources for itself
    return holder_ids, holders, running


def _rank(b: Book, t: Tenant, now: float, preemptive: bool, timeshare: bool) -> _Rank:
    """A tenant's place in the greedy order (lower first)."""
    name = t.spec.name
    cls = 0.0 if (preemptive and t.spec.priority is Priority.ONLINE) else 1.0
    held = _holds(b.holders, name, t)
    if timeshare:
        if t.turn_started is None:
            return (cls, 1.0, t.last_run_end, name)
        if held and now - t.turn_started < turn_window(b, t) - TURN_EPS_S:
            return (cls, 0.0, t.last_run_end, name)
        return (cls, 1.0, now, name)  # its turn is over: behind everyone who waited (round robin)
    vclock = b.vclock
    lag = max(e[VALUE] - vclock[rid] for rid, e in t.entries.items())
    return (cls, lag, 0.0 if held else 1.0, name)
