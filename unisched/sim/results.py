"""What a simulation run measured: per tenant, per resource, each wake-up, and the policy's decision cost."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unisched.policy import Resource
from unisched.sim.workload import SimTenant

__all__ = ["ResourceResult", "SimResult", "TenantResult", "WakeEvent", "weight_shares"]

WAKE_SLACK_SLICES = 1.0
"""A waking tenant 'has its share' from the slice end on after which its GPU time since it woke stays within
this many slices of what it was owed since then: its weight share of the resource's busy time, the share
following who has work moment by moment (slices are the granularity)."""


@dataclass(frozen=True)
class WakeEvent:
    """An idle tenant (no demand, thawed) that starts work."""

    tenant: str
    at_s: float
    resource: Resource
    """Its first stream's resource, where the latencies are measured."""
    share: float
    """Its weight share of `resource` among the tenants with work there when it woke."""
    debt_s: float
    """GPU seconds it was ahead of the slowest tenant with demand on `resource` (its last burst got more than
    its share): the policy then lets it wait until the others have caught up. 0 when it was owed nothing."""
    slices_to_run: int | None
    """Decisions after the wake until it was first running (None: not while it was followed)."""
    slices_to_share: int | None
    """Slice ends after the wake from which on its GPU time since the wake stayed within WAKE_SLACK_SLICES of
    its share of the busy time, while followed (None: it was further behind at the end)."""


@dataclass(frozen=True)
class TenantResult:
    name: str
    weight: int
    gpu_s: dict[Resource, float]
    """GPU time used in the measured window, per resource."""
    expected_s: dict[Resource, float]
    """Its weight share of each resource's busy time while it had work (the fair amount)."""
    items: int
    """Work items completed in the measured window (throughput)."""


@dataclass(frozen=True)
class ResourceResult:
    resource: Resource
    busy_s: float
    wanted_s: float
    """Time some tenant had work for it (running or frozen)."""
    contended_s: float
    """Time two or more tenants had work for it."""

    @property
    def efficiency(self) -> float:
        return self.busy_s / self.wanted_s if self.wanted_s > 0 else 1.0


@dataclass(frozen=True)
class SimResult:
    window_s: float
    slices: int
    tenants: tuple[TenantResult, ...]
    resources: tuple[ResourceResult, ...]
    wakes: tuple[WakeEvent, ...]
    decide_ns: tuple[int, ...]

    def shares(self, resource: Resource) -> dict[str, tuple[float, float]]:
        """Per tenant on `resource`: (its share of the GPU time used there, its fair share of it)."""
        used = {t.name: t.gpu_s.get(resource, 0.0) for t in self.tenants}
        fair = {t.name: t.expected_s.get(resource, 0.0) for t in self.tenants}
        total_used, total_fair = sum(used.values()), sum(fair.values())
        if total_used <= 0 or total_fair <= 0:
            return {}
        return {n: (used[n] / total_used, fair[n] / total_fair) for n in used if used[n] > 0 or fair[n] > 0}

    def share_errors(self, contended_only: bool = True) -> dict[tuple[str, Resource], float]:
        """|measured share - fair share| in percentage points, per tenant and resource."""
        out = {}
        for r in self.resources:
            if contended_only and r.contended_s <= 0:
                continue
            for name, (measured, fair) in self.shares(r.resource).items():
                out[(name, r.resource)] = abs(measured - fair) * 100.0
        return out

    def share_error_points(self, contended_only: bool = True, tenants: Iterable[str] | None = None) -> float:
        """Max over tenants (all, or those named) and resources of |measured share - fair share|, in points."""
        names = None if tenants is None else set(tenants)
        errors = [e for (n, _), e in self.share_errors(contended_only).items() if names is None or n in names]
        return max(errors, default=0.0)

    def efficiency(self, contended_only: bool = True) -> tuple[float, float]:
        """(lowest, mean) busy fraction of the resources while some tenant had work for them."""
        effs = [r.efficiency for r in self.resources if r.wanted_s > 0 and (r.contended_s > 0 or not contended_only)]
        if not effs:
            return (1.0, 1.0)
        return (min(effs), sum(effs) / len(effs))


def weight_shares(tenants: Sequence[SimTenant]) -> dict[str, float]:
    """Each tenant's weight over the sum (its fair share when all saturate one resource)."""
    total = sum(t.weight for t in tenants)
    return {t.name: t.weight / total for t in tenants}
