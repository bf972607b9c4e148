"""Turns of several units for cooperative tenants with long ones: each tenant's mean unit (a step or a frame, as
its reports count them) and the minimum run it earns, told to the policy, for LeaseBook."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from unisched.policy import WeightedFairShare
from unisched.policy.tuning import TUNING

__all__ = ["Turns", "min_run_for"]

log = structlog.get_logger("unisched.scheduler")


def min_run_for(unit_s: float, slice_s: float, max_run_s: float, handover_s: float = 0.0) -> float:
    """The minimum run a tenant with units of `unit_s` earns: Tuning.run_units of them, and long enough that a
    hand-over gap of `handover_s` costs at most Tuning.handover_share of it; at most `max_run_s`, and 0 below two
    slices (a turn of two slices is what the holder's tie rule gives anyway)."""
    share = TUNING.handover_share
    run = min(max_run_s, max(TUNING.run_units * unit_s, handover_s / share if share > 0 else 0.0))
    return run if run >= 2 * slice_s else 0.0


class Turns:
    """Each cooperative tenant's mean unit length and the minimum run it earns (set on the policy)."""

    def __init__(self, policy: WeightedFairShare, slice_s: float, max_run_s: float) -> None:
        self.policy = policy
        self.slice_s = slice_s
        self.max_run_s = max_run_s
        """Cap on the minimum run that long units earn (Tuning.run_units); 0 = turns of one slice whatever the units."""
        self._unit_s: dict[str, float] = {}
        """Each cooperative tenant's mean unit length (GPU seconds per step or frame it reported)."""
        self._min_run: dict[str, float] = {}
        """The minimum run last given to the policy per tenant."""
        self._unit_acc_s: dict[str, float] = {}
        """GPU seconds reported since the tenant's last whole unit (parts of one, see clients' pause points)."""
        self._tainted: set[str] = set()
        """Tenants whose unit in progress had a part that ran beside other work (`skip`): its length is not learnt."""
        self._runs: set[str] = set()
        """Tenants whose units earn minimum runs (they reported compute steps)."""
        self._logged_run: dict[str, float] = {}
        """The minimum run last logged per tenant: the mean drifts in small steps (from a first step's autotuning
        down to its steady unit), and each must not hide behind the one before."""

    def report(self, tenant: str, gpu_s: float, units: int, gap_s: Callable[[], float], earns_run: bool = True) -> None:
        """GPU time the tenant reported, covering `units` whole units; `gap_s()`: the longest mean hand-over
        gap on its resources. `earns_run`: long units earn a minimum run (compute steps); frames do not (two
        renders time-slice at no loss, so longer turns would only stall each one's frames), but their mean length
        is still what the `beside` rule reads (policy.reports)."""
        # parts of a unit that pause points ended come in reports of 0 units: their time counts toward the unit
        # that a later report completes, so a step split across reports is still one step long
        acc = self._unit_acc_s.get(tenant, 0.0) + gpu_s
        self._unit_acc_s[tenant] = 0.0 if units else acc
        if not units:
            return
        if tenant in self._tainted:  # the first of these units had a part beside other work: their mean is off
            self._tainted.discard(tenant)
            return
        old = self._unit_s.get(tenant)
        unit = acc / units if old is None else old + TUNING.unit_ewma * (acc / units - old)
        self._unit_s[tenant] = unit
        if earns_run:
            self._runs.add(tenant)
            self._set_min_run(tenant, unit, gap_s())

    def regap(self, tenant: str, gap_s: float) -> None:
        """A new mean hand-over gap on a resource the tenant uses: its minimum run follows (its units count only if
        they earn runs)."""
        self._set_min_run(tenant, self._unit_s.get(tenant, 0.0) if tenant in self._runs else 0.0, gap_s)

    def _set_min_run(self, tenant: str, unit: float, gap_s: float) -> None:
        run = min_run_for(unit, self.slice_s, self.max_run_s, gap_s)
        last = self._min_run.get(tenant, 0.0)
        if abs(run - last) <= 0.1 * max(run, last):
            return
        self._min_run[tenant] = run
        self.policy.set_min_run(tenant, run)
        logged = self._logged_run.get(tenant, 0.0)
        if (run == 0.0) != (logged == 0.0) or abs(run - logged) > 0.25 * max(run, logged):
            self._logged_run[tenant] = run
            reason = ("units long against the slice" if run and run <= TUNING.run_units * unit + 1e-9 else
                      "hand-overs long against the slice" if run else "units and hand-overs short against the slice")
            log.info("lease turns", tenant=tenant, unit_ms=round(unit * 1000, 2), min_run_ms=round(run * 1000, 1),
                     handover_ms=round(gap_s * 1000, 3), reason=reason)

    def skip(self, tenant: str, units: int) -> None:
        """A report whose time says nothing of its units' length (it ran beside another tenant's work: after a freeze,
        or policy.reports' `learn` rule). A part of a unit (`units` 0, pause points split a step across reports) taints
        the unit in progress, which would read short without it: that unit is not learnt either. Whole units end the
        unit in progress, so the next starts clean (tainting it would leave a client with short turns, whose first and
        last reports are beside the app, no report to learn from)."""
        self._unit_acc_s[tenant] = 0.0
        if units:
            self._tainted.discard(tenant)
        else:
            self._tainted.add(tenant)

    def drop(self, tenant: str) -> None:
        """No lease session left: a freezer-governed tenant again, turned one slice at a time."""
        self._unit_s.pop(tenant, None)
        self._runs.discard(tenant)
        self._logged_run.pop(tenant, None)
        self._unit_acc_s.pop(tenant, None)
        self._tainted.discard(tenant)
        if self._min_run.pop(tenant, 0.0):
            self.policy.set_min_run(tenant, 0.0)

    def unit_s(self, tenant: str) -> float | None:
        """The tenant's mean unit length, once it reported counted units."""
        return self._unit_s.get(tenant)

    def min_run_s(self, tenant: str) -> float:
        """The minimum run its units earned (0: turns of a slice)."""
        return self._min_run.get(tenant, 0.0)
