"""GPU memory caps and reserves: whether one allocation fits, and whether a tenant's reserve fits a GPU.

Pure arithmetic on byte counts per GPU; the session hooks supply what each tenant holds (exact, from the
allocations and frees they see) and the engine the terms. Both numbers are per GPU: a tenant capped at 4 GiB
may hold 4 GiB on each GPU it uses, and a reserve of 2 GiB is kept for it on each GPU it may use (all of them
unless it is pinned to some).

The guarantee: a tenant below its reserve is never refused by these rules (only the driver, if the memory
is not there); any other allocation is refused when it would take the tenant over its cap, or eat into what
other tenants hold or are owed: sum over others of max(held, reserve) + this tenant's new total > the GPU's
memory. So the reserves leave room for each other (their sum never exceeds the GPU, `check_reserve`), and
caps of others leave room for them. A tenant pinned to some GPUs is refused any allocation on another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from unisched.policy.model import PolicyError

__all__ = ["MemoryTerms", "Verdict", "admit_allocation", "check_reserve", "reserve_on"]


@dataclass(frozen=True)
class MemoryTerms:
    """One tenant's memory terms, per GPU."""

    cap: int | None = None
    """Most bytes it may hold on one GPU; None: no cap."""
    reserve: int = 0
    """Bytes kept for it on each GPU it may use."""
    gpus: frozenset[int] | None = None
    """The GPUs it may use (where its reserve is kept); None: every GPU."""

    def __post_init__(self) -> None:
        if self.cap is not None and (isinstance(self.cap, bool) or self.cap < 0):
            raise PolicyError(f"memory cap must be a non-negative number of bytes, got {self.cap!r}")
        if isinstance(self.reserve, bool) or self.reserve < 0:
            raise PolicyError(f"memory reserve must be a non-negative number of bytes, got {self.reserve!r}")
        if self.cap is not None and self.reserve > self.cap:
            raise PolicyError(f"memory reserve {self.reserve} B exceeds the tenant's own cap {self.cap} B")


class Verdict(StrEnum):
    ADMIT = "admit"
    CAP = "cap"
    """It would take the tenant over its own cap."""
    RESERVES = "reserves"
    """It would eat into what other tenants hold or are owed on this GPU."""
    GPU = "not its gpu"
    """The GPU is not one the tenant may use: its device cgroup keeps a real app off it, so the call is made up (the
    hooks cannot see which file it is on), and charged it would eat into others' reserves there."""


def reserve_on(terms: MemoryTerms, gpu: int) -> int:
    """The tenant's reserve on `gpu` (0 on a GPU it may not use)."""
    return terms.reserve if terms.gpus is None or gpu in terms.gpus else 0


def admit_allocation(
    tenant: str, gpu: int, nbytes: int, held: Mapping[str, int], terms: Mapping[str, MemoryTerms], total: int | None
) -> Verdict:
    """Whether `tenant` may allocate `nbytes` more on `gpu`, where each tenant holds `held[name]` bytes now and
    the GPU has `total` bytes (None: not known, so only caps apply). Tenants absent from `terms` have none. A
    negative `gpu` stands for none known (the hooks' UNKNOWN_GPU): no tenant's GPUs, no size, so caps only."""
    mine = held.get(tenant, 0) + nbytes
    own = terms.get(tenant, MemoryTerms())
    if own.gpus is not None and gpu >= 0 and gpu not in own.gpus:
        return Verdict.GPU
    if own.cap is not None and mine > own.cap:
        return Verdict.CAP
    if total is None or mine <= reserve_on(own, gpu):
        return Verdict.ADMIT
    # sum over the others of max(held, reserve): what they all hold, plus what each reserve is owed beyond it
    # (a walk over the tenants with terms only: the others hold no reserve)
    others = sum(held.values()) - held.get(tenant, 0)
    others += sum(max(0, reserve_on(t, gpu) - held.get(n, 0)) for n, t in terms.items() if n != tenant)
    return Verdict.RESERVES if others + mine > total else Verdict.ADMIT


def check_reserve(tenant: str, own: MemoryTerms, others: Mapping[str, MemoryTerms], totals: Mapping[int, int]) -> str | None:
    """Why `tenant`'s reserve does not fit beside the other tenants' on some GPU of `totals` (GPU -> bytes), or
    None when it fits everywhere (also when no GPU's size is known: nothing to check against)."""
    for gpu, total in sorted(totals.items()):
        mine = reserve_on(own, gpu)
        if not mine:
            continue
        holders = {n: reserve_on(t, gpu) for n, t in others.items() if n != tenant and reserve_on(t, gpu)}
        if mine + sum(holders.values()) > total:
            owed = ", ".join(f"{n} {_gib(b)}" for n, b in sorted(holders.items())) or "none"
            return (f"memory reserve {_gib(mine)} of tenant {tenant!r} does not fit on GPU {gpu}: it has "
                    f"{_gib(total)} and other tenants reserve {_gib(sum(holders.values()))} there ({owed})")
    return None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
