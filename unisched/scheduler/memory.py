"""GPU memory terms as the engine holds them, for the session hooks' ledger and for reserve admission.

The hooks decide each allocation on their own thread (enforce.seccomp.ledger.MemoryLedger); these functions are
what they read: every tenant's cap and reserve per GPU, and each GPU's size. They only read values that are
replaced whole (a tenant's frozen SessionLimits, the telemetry's GPU list), so calling them from that thread
while the event loop changes tenants is safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.policy.caps import SessionLimits
from unisched.policy.memory import MemoryTerms, reserve_on
from unisched.telemetry import GpuInfo


def terms_of(limits: SessionLimits, gpus: Sequence[int] | None) -> MemoryTerms:
    return MemoryTerms(cap=limits.memory_bytes, reserve=limits.memory_reserve or 0,
                       gpus=frozenset(gpus) if gpus else None)


def gpu_totals(gpus: Iterable[GpuInfo]) -> dict[int, int]:
    """GPU index -> bytes, for the GPUs whose size is known."""
    return {g.index: g.memory_total for g in gpus if g.memory_total > 0}


@dataclass(frozen=True)
class GpuMemory:
    """One tenant's video memory on one GPU, as the session hooks count it."""

    gpu: int
    used: int
    cap: int | None
    reserve: int
    refused: int
    """Allocations refused (cap or others' reserves) since the daemon started."""


def gpu_memory(ledger: MemoryLedger | None, name: str, limits: SessionLimits, gpus: Sequence[int] | None,
               known_gpus: Iterable[int]) -> tuple[GpuMemory, ...]:
    """Per GPU where the tenant holds memory, was refused some, or has a reserve."""
    held: Mapping[int, int] = {}
    refused: Mapping[int, int] = {}
    if ledger is not None:
        mine = ledger.of(name)
        held, refused = mine.held, mine.refused
    terms = terms_of(limits, gpus)
    listed = set(held) | set(refused) | {g for g in known_gpus if reserve_on(terms, g)}
    return tuple(GpuMemory(g, held.get(g, 0), limits.memory_bytes, reserve_on(terms, g), refused.get(g, 0))
                 for g in sorted(listed))
