"""The lazy min-heaps the fair share keeps per resource: entries are re-placed only when they surface, so a
charge costs O(1) and a decision O(log N) per contended resource (see the package docstring)."""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

__all__ = ["KEY", "MULTI", "NAME", "OFFLINE", "ONLINE", "OWNER", "SEQ", "SINGLE", "VALUE", "Entry", "Index", "at_most", "push",
           "settle"]

#   placed. A vtime only grows while the tenant has demand, so `key` is a lower bound of `value`: a charge
#   just raises `value` (no heap work), and a top whose key is behind its value is re-placed when it
#   surfaces. A top with key == value is then the true minimum.
# - turn heaps (timeshare): key == value == the end of the tenant's last turn.
# `seq` makes every entry unique; `owner` is the Tenant, or None once the entry is dead (lazy deletion).
Entry = list[Any]
KEY, NAME, SEQ, OWNER, VALUE = 0, 1, 2, 3, 4
MULTI, SINGLE = 0, 1
ONLINE, OFFLINE = 0, 1
_COMPACT_MIN = 64
"""A heap is rebuilt without its dead entries once it is this long and mostly dead."""
_SCAN_MAX = 32
"""Multi-resource heaps up to this long are scanned; longer ones are walked from the root."""




class Index:
    """The tenants active on one resource, as lazy min-heaps.

    `vt[slot]` (slot = class * 2 + kind) is keyed by virtual time. Classes are split only in preemptive
    mode (otherwise every tenant is in the offline heaps). `turn[kind]` (timeshare mode only) is keyed by
    the end of the tenant's last turn and holds only tenants that are not in a turn now.
    """

    __slots__ = ("active", "turn", "turn_alive", "vt", "vt_alive")

    def __init__(self) -> None:
        self.vt: tuple[list[Entry], ...] = ([], [], [], [])
        self.vt_alive = [0, 0, 0, 0]
        self.turn: tuple[list[Entry], ...] = ([], [])
        self.turn_alive = [0, 0]
        self.active = 0



def push(heap: list[Entry], alive: int, entry: Entry) -> None:
    """Push; when the heap is mostly dead entries, rebuild it (in place) from the live ones."""
    heapq.heappush(heap, entry)
    if len(heap) > _COMPACT_MIN and len(heap) > 3 * alive:
        heap[:] = [e for e in heap if e[OWNER] is not None]
        heapq.heapify(heap)


def settle(heap: list[Entry]) -> Entry | None:
    """The live entry with the lowest value (dropping dead tops, re-placing tops whose key lags)."""
    while heap:
        top = heap[0]
        if top[OWNER] is None:
            heapq.heappop(heap)
        elif top[KEY] != top[VALUE]:
            top[KEY] = top[VALUE]
            heapq.heapreplace(heap, top)
        else:
            return top
    return None


def at_most(heap: list[Entry], bound: float) -> Iterator[Entry]:
    """The live entries whose value is <= bound, without changing the heap.

    A scan when the heap is short, else a walk down from the root that stops below entries whose key is
    past the bound (their children's keys, and so values, are later still).
    """
    if len(heap) <= _SCAN_MAX:
        for entry in heap:
            if entry[VALUE] <= bound and entry[OWNER] is not None:
                yield entry
        return
    n = len(heap)
    stack = [0]
    while stack:
        i = stack.pop()
        entry = heap[i]
        if entry[KEY] > bound:
            continue
        if entry[VALUE] <= bound and entry[OWNER] is not None:
            yield entry
        i = 2 * i + 1
        if i < n:
            stack.append(i)
            if i + 1 < n:
                stack.append(i + 1)

