"""The entries the hooks' books may hold for one TENANT, all its listeners together, and for one USER, all the
listeners it handed over together. Pure: no I/O, no clock.

Each listener (one hooked process group: a container, a `unisched run`) has its own books, each bounded on its own
(memory.BookBounds, accounting.SessionBounds), and a tenant may have many listeners (hooks.MAX_LISTENERS_PER_TENANT),
so the per-listener bounds alone let one user multiply what the root daemon holds by the listeners it starts; and a
user may create many tenants (registration.MAX_USER_TENANTS). An `Allowance` is shared by a group of books: one per
tenant (hooks.TENANT_BOUNDS) and one per non-root user that hands listeners over (hooks.USER_BOUNDS), both kept by
hooks.SupervisedHooks. Each book draws on its allowances through a `Share` of its own: it takes an entry from all of
them when it records one and gives it back to all when it drops it. The share counts what its book took, so it never
gives back more than that (a free of an unknown handle, a double free, or the exit of a process never seen cannot make
a count drift or go negative), and the book's close gives back whatever it still held, so a listener that ends leaks
nothing.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from enum import StrEnum

__all__ = ["Allowance", "Entry", "Share"]


class Entry(StrEnum):
    """The kinds of book entry bounded per tenant and per user (what each is: memory.py and accounting.py)."""

    MEMORY_CLIENTS = "memory book RM clients"
    DEVICES = "device and subdevice handles"
    ALLOCATIONS = "video memory allocations"
    HANDLES = "replayed driver-picked handles"
    SESSION_CLIENTS = "session book RM clients"
    NODES = "RM objects in the session trees"
    SESSION_OBJECTS = "session objects"


class Allowance:
    """Entries a group of books holds (one tenant's, or one user's), against `bounds`. Thread-safe: each listener's
    supervisor is a thread. Allowances one book draws on together must share one `lock` (a Share checks and counts
    all of them at once)."""

    def __init__(self, name: str, bounds: Mapping[Entry, int], lock: threading.Lock | None = None) -> None:
        self.name = name
        self._bounds = dict(bounds)
        self._lock = lock if lock is not None else threading.Lock()
        self._used: collections.Counter[Entry] = collections.Counter()

    def used(self) -> dict[Entry, int]:
        with self._lock:
            return {kind: n for kind, n in self._used.items() if n}


class Share:
    """One book's part of its allowances (module docstring): its tenant's and, for a listener a non-root user handed
    over, that user's. Without any it only counts what its book holds, and never refuses: a book of no tenant's hooks
    (tests, a lone supervisor)."""

    def __init__(self, *allowances: Allowance | None) -> None:
        self._allowances = tuple(a for a in allowances if a is not None)
        locks = {id(a._lock) for a in self._allowances}
        if len(locks) > 1:
            raise ValueError("the allowances of one share must share one lock")
        self._lock = self._allowances[0]._lock if self._allowances else threading.Lock()
        self._held: collections.Counter[Entry] = collections.Counter()

    def room(self, kind: Entry) -> bool:
        """Whether the book may record one more `kind` (ask before a `take(kind, force=True)`)."""
        with self._lock:
            return all(a._used[kind] < a._bounds[kind] for a in self._allowances)

    def take(self, kind: Entry, *, force: bool = False) -> bool:
        """Count one more `kind`, unless that takes one of its allowances past its bound (False, nothing counted).
        `force`: count it anyway, for an entry whose room was asked before a wait (a decision, a book's own checks):
        another listener of the tenant (or the user) may have taken the last one meanwhile, so a bound is overshot by
        at most one entry per listener then."""
        with self._lock:
            if not force:
                for a in self._allowances:  # (a loop, not any() of a generator: taken on every booked call)
                    if a._used[kind] >= a._bounds[kind]:
                        return False
            for a in self._allowances:
                a._used[kind] += 1
            self._held[kind] += 1
            return True

    def give(self, kind: Entry, n: int = 1) -> None:
        """Give back `n` of `kind` the book dropped; never more than it took."""
        with self._lock:
            n = min(n, self._held[kind])
            if n <= 0:
                return
            self._held[kind] -= n
            for a in self._allowances:
                a._used[kind] -= n

    def give_all(self) -> None:
        """The book is closed (its listener ended): give back all it still held."""
        for kind in list(self._held):
            self.give(kind, self._held[kind])

    def held(self) -> dict[Entry, int]:
        with self._lock:
            return {kind: n for kind, n in self._held.items() if n}
