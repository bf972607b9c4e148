"""`MemoryLedger`, shared by every listener's book (memory.py): bytes held per tenant and GPU, charged and credited
by the books, and each allocation admitted or refused by policy.memory.admit_allocation under one lock, so two
tenants' allocations never both take the last free bytes."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from unisched.enforce.seccomp.memory import Held
from unisched.policy.memory import MemoryTerms, Verdict, admit_allocation

__all__ = ["MemoryLedger", "TenantMemory"]


@dataclass(frozen=True)
class TenantMemory:
    """What /metrics and `unisched tenants` show per tenant and GPU."""

    held: Mapping[int, int]
    refused: Mapping[int, int]
    """Allocations refused per GPU (cap, reserves, or the book's bounds)."""


class MemoryLedger:
    """Bytes held per tenant and GPU, shared by every listener's book (thread-safe).

    `terms()` gives each tenant's MemoryTerms and `totals()` each GPU's size in bytes (GPUs absent: not known,
    caps only); both are read outside the lock on every allocation, so they must be quick and never block. A
    mapping `terms()` gave is never changed in place (a change is a new mapping): the tenants with a reserve in it
    are found once (`_checked`).
    """

    def __init__(self, terms: Callable[[], Mapping[str, MemoryTerms]],
                 totals: Callable[[], Mapping[int, int]] = lambda: {}) -> None:
        self._terms = terms
        self._totals = totals
        self._reserves: tuple[Mapping[str, MemoryTerms], Mapping[str, MemoryTerms]] = ({}, {})  # terms(), its reserves
        self._lock = threading.Lock()
        self._held: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._refused: collections.Counter[tuple[str, int]] = collections.Counter()

    def charge(self, tenant: str, gpu: int, nbytes: int) -> Verdict:
        """Admit and count an allocation, or say why not (counted as refused)."""
        terms = self._checked(self._terms(), tenant)
        total = self._totals().get(gpu)
        with self._lock:
            held = self._held[gpu]
            verdict = admit_allocation(tenant, gpu, nbytes, held, terms, total)
            if verdict is Verdict.ADMIT:
                held[tenant] += nbytes
            else:
                self._refused[(tenant, gpu)] += 1
            return verdict

    def _checked(self, terms: Mapping[str, MemoryTerms], tenant: str) -> Mapping[str, MemoryTerms]:
        """The terms an allocation of `tenant` is checked against: its own and the reserves. A tenant pinned to GPUs
        has terms for that alone (on a node of pods, every one), and the check walks the others' terms."""
        last, reserves = self._reserves
        if last is not terms:
            reserves = MappingProxyType({n: t for n, t in terms.items() if t.reserve})
            self._reserves = (terms, reserves)
        own = terms.get(tenant)
        return reserves if own is None or tenant in reserves else {**reserves, tenant: own}

    def refuse(self, tenant: str, gpu: int) -> None:
        """Count an allocation refused without a charge (its book could not record it)."""
        with self._lock:
            self._refused[(tenant, gpu)] += 1

    def credit(self, tenant: str, given_back: list[Held]) -> None:
        with self._lock:
            for h in given_back:
                held = self._held[h.gpu]
                held[tenant] = max(0, held[tenant] - h.nbytes)
                if not held[tenant]:
                    del held[tenant]

    def of(self, tenant: str) -> TenantMemory:
        with self._lock:
            held = {gpu: c[tenant] for gpu, c in self._held.items() if c.get(tenant)}
            refused = {gpu: n for (t, gpu), n in self._refused.items() if t == tenant}
        return TenantMemory(held, refused)

    def held_on(self, gpu: int) -> dict[str, int]:
        with self._lock:
            return dict(self._held.get(gpu, {}))
