"""The entries the hooks' books may hold for one TENANT, all its listeners together. Pure: no I/O, no clock.

Each listener (one hooked process group: a container, a `unisched run`) has its own books, each bounded on its own
(memory.BookBounds, accounting.SessionBounds), and a tenant may have many listeners (hooks.MAX_LISTENERS_PER_TENANT),
so the per-listener bounds alone let one user multiply what the root daemon holds by the listeners it starts. A
`TenantAllowance` is shared by all of one tenant's books (hooks.SupervisedHooks keeps one per tenant; its bounds are
hooks.TENANT_BOUNDS). Each book draws on it through a `Share` of its own: it takes an entry when it records one and
gives it back when it drops it. The share counts what its book took, so it never gives back more than that (a free
of an unknown handle, a double free, or the exit of a process never seen cannot make the tenant's count drift or go
negative), and the book's close gives back whatever it still held, so a listener that ends leaks nothing.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from enum import StrEnum

__all__ = ["Entry", "Share", "TenantAllowance"]


class Entry(StrEnum):
    """The kinds of book entry bounded per tenant (what each is: memory.py and accounting.py)."""

    MEMORY_CLIENTS = "memory book RM clients"
    DEVICES = "device and subdevice handles"
    ALLOCATIONS = "video memory allocations"
    HANDLES = "replayed driver-picked handles"
    SESSION_CLIENTS = "session book RM clients"
    NODES = "RM objects in the session trees"
    SESSION_OBJECTS = "session objects"


class TenantAllowance:
    """Entries one tenant's books hold, against `bounds` (thread-safe: each listener's supervisor is a thread)."""

    def __init__(self, tenant: str, bounds: Mapping[Entry, int]) -> None:
        self.tenant = tenant
        self._bounds = dict(bounds)
        self._lock = threading.Lock()
        self._used: collections.Counter[Entry] = collections.Counter()

    def used(self) -> dict[Entry, int]:
        with self._lock:
            return {kind: n for kind, n in self._used.items() if n}


class Share:
    """One book's part of its tenant's allowance (module docstring). Without an allowance it only counts what its
    book holds, and never refuses: a book of no tenant's hooks (tests, a lone supervisor)."""

    def __init__(self, allowance: TenantAllowance | None = None) -> None:
        self._allowance = allowance
        self._lock = threading.Lock() if allowance is None else allowance._lock
        self._held: collections.Counter[Entry] = collections.Counter()

    def room(self, kind: Entry) -> bool:
        """Whether the tenant may record one more `kind` (ask before a `take(kind, force=True)`)."""
        a = self._allowance
        if a is None:
            return True
        with self._lock:
            return a._used[kind] < a._bounds[kind]

    def take(self, kind: Entry, *, force: bool = False) -> bool:
        """Count one more `kind`, unless that takes the tenant past its bound (False, nothing counted). `force`: count
        it anyway, for an entry whose room was asked before a wait (a decision, a book's own checks): another listener
        of the tenant may have taken the last one meanwhile, so the bound is overshot by at most one entry per
        listener then."""
        a = self._allowance
        with self._lock:
            if a is not None:
                if not force and a._used[kind] >= a._bounds[kind]:
                    return False
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
            if self._allowance is not None:
                self._allowance._used[kind] -= n

    def give_all(self) -> None:
        """The book is closed (its listener ended): give back all it still held."""
        for kind in list(self._held):
            self.give(kind, self._held[kind])

    def held(self) -> dict[Entry, int]:
        with self._lock:
            return {kind: n for kind, n in self._held.items() if n}
