"""What a cooperative tenant's report is charged, and to whom, for LeaseBook: its GPU time less the work of others
its units timed (a frozen tenant's drain, a thawed tenant's work beside its tail, an overlap's credit), placed in
time for the tick, and the overruns beyond its leases that make the freezer back them.

Apart from scheduler.leases, which keeps the sessions, their demand and their leases: these are the charging rules
a report goes through (docs/design/scheduling.md, Charging), with the state only they keep.
"""

from __future__ import annotations

from collections.abc import Collection

import structlog

from unisched.policy import ChargeKind, ChargeSource, Engine, Resource, WeightedFairShare
from unisched.policy.callers import Caller, named
from unisched.policy.leases import OverrunMeter, OverrunVerdict
from unisched.policy.plan import Rule
from unisched.policy.reports import EVEN_SLICING, beside_excess, learnable_tail, report_pieces
from unisched.policy.tuning import TUNING
from unisched.scheduler.handovers import Handovers
from unisched.scheduler.lease_records import CoopRecord, LeaseRecord, SessionRecord

__all__ = ["LeaseCharges"]

log = structlog.get_logger("unisched.scheduler")

REPORTED = ChargeKind(Rule.REPORT, ChargeSource.REPORTED)
"""A cooperative tenant's own work, as its report gave it."""
REPORTED_DRAIN = ChargeKind(Rule.REPORT, ChargeSource.DRAIN)
"""A freezer-governed tenant's work queued at its freeze, as a holder's first units after it timed it."""


class LeaseCharges:
    """The charges of cooperative tenants' reports: to the policy, placed in time (`take_reported`), and their
    overruns (`enforced`). `handovers` are the book's: an overlap's credit is taken off the charge."""

    def __init__(self, policy: WeightedFairShare, slice_s: float, handovers: Handovers) -> None:
        self.policy = policy
        self.slice_s = slice_s
        self._handovers = handovers
        self._enforced: set[str] = set()
        """Tenants that kept overrunning: the freezer backs their leases from then on (kept across sessions)."""
        self._enforced_users: set[Caller] = set()
        """Users (uids, not admins, or pods whatever uids their processes take) whose sessions kept overrunning: every
        tenant they open a session in is enforced, so removing a tenant and making it again, under any name, does not
        wipe the record (kept until restart; a pod's until its last session ends). A pod's record is its own: the host
        user of the uid its processes ran as keeps a clean one."""
        self._overrun: dict[str, float] = {}
        """GPU seconds each tenant reported beyond its leases (kept across sessions)."""
        self._reported: dict[Resource, list[tuple[float, float]]] = {}
        """(arrival, GPU seconds) of each report per resource since the last `take_reported`."""

    def take_reported(self) -> dict[Resource, list[tuple[float, float]]]:
        """The reports per resource since the last call, as (arrival, GPU seconds): the freezer-governed tenants that ran
        beside cooperative ones are charged the busy time less the work these cover (policy.charging.cooperative_part)."""
        out, self._reported = self._reported, {}
        return out

    def enforced(self, tenant: str) -> bool:
        return tenant in self._enforced

    def enforced_names(self) -> Collection[str]:
        """The tenants whose leases the freezer backs (live; do not modify)."""
        return self._enforced

    def user_enforced(self, user: Caller) -> bool:
        return user in self._enforced_users

    def enforce_user(self, user: Caller, tenant: str) -> None:
        """`user` has or opens a session in `tenant`: the tenant is enforced if that user's sessions kept
        overrunning."""
        if user in self._enforced_users and tenant not in self._enforced:
            self._enforced.add(tenant)
            log.warning("lease overrun: the freezer backs this tenant's leases, as its user's leases overran before",
                        tenant=tenant, user=named(user))

    def forget_user(self, user: Caller) -> None:
        """`user`'s record of overruns is dropped (a pod gone: leases.LeaseBook._left)."""
        self._enforced_users.discard(user)

    def overrun_s(self, tenant: str) -> float:
        return self._overrun.get(tenant, 0.0)

    def forget(self, tenant: str) -> None:
        """The tenant is removed: its overruns go with it."""
        self._enforced.discard(tenant)
        self._overrun.pop(tenant, None)

    def meter(self, c: CoopRecord, r: Resource) -> OverrunMeter:
        m = c.meters.get(r)
        if m is None:
            m = c.meters[r] = OverrunMeter(TUNING.overrun_window_slices * self.slice_s, self.slice_s,
                                              TUNING.strikes_to_enforce)
        return m

    def charge(self, s: SessionRecord, c: CoopRecord, r: Resource, engine: Engine, gpu_s: float, units: int,
               unit_s: float | None, at: float, thawed_at: float | None, now: float) -> tuple[OverrunVerdict | None, float]:
        """Charge a report of `gpu_s` on `r` whose work ended `at`: `unit_s` is the tenant's usual unit (before this
        report), `thawed_at` when a freezer-governed tenant was thawed beside its tail (None: none). Returns the
        overrun verdict and the part of its own work its units' usual length may learn (0: none)."""
        verdict = None
        frozen, drain = self._frozen_drain(c.leases.get(r), gpu_s, units, unit_s)
        gpu_s -= drain
        # its own work as the units' usual length may learn it: not from what the `beside` rule cut to that length
        # (a circle that keeps any estimate): a report after a freeze is left out, a tail by the `learn` rule
        own_s = 0.0 if frozen is not None else gpu_s
        charged = self._handovers.less_credit(s.tenant, r, gpu_s)
        pieces: tuple[tuple[float, float], ...] = ((at, charged),)
        if thawed_at is not None and charged > 0:  # its tail beside the freezer-governed tenant thawed for its turn
            excess = beside_excess(charged, units, unit_s, at - thawed_at, EVEN_SLICING)
            pieces = report_pieces(at, charged, excess, thawed_at)
            charged -= excess
            gpu_s -= excess
            if own_s:
                own_s = learnable_tail(own_s, at - thawed_at, unit_s, engine is not Engine.COMPUTE)
        if frozen is not None and drain > 0:
            self._charge_drain(frozen, r, drain, at - gpu_s, now)
        if charged > 0:  # what it is charged: the busy time that was its work, and when it ran
            self._reported.setdefault(r, []).extend(pieces)
            self.policy.charge(s.tenant, r, charged, now, REPORTED)
            verdict = self.meter(c, r).report(charged, now)
            if verdict is not None and verdict.overrun_s > 0:
                self._overrun[s.tenant] = self._overrun.get(s.tenant, 0.0) + verdict.overrun_s
                log.warning("lease overrun", tenant=s.tenant, engine=engine.value, overrun_s=round(verdict.overrun_s, 4),
                            strikes=verdict.strikes)
                if verdict.enforce and s.user is not None:
                    self._enforced_users.add(s.user)
                if verdict.enforce and s.tenant not in self._enforced:
                    self._enforced.add(s.tenant)
                    log.warning("lease overrun: the freezer now backs this tenant's leases", tenant=s.tenant)
        if s.debug:
            s.log.debug("lease charge", charged_s=round(charged, 5), drain_s=round(drain, 5), own_s=round(own_s, 5),
                        beside=thawed_at is not None, unit_ms=None if unit_s is None else round(unit_s * 1000, 3))
        return verdict, own_s

    def _frozen_drain(self, held: LeaseRecord | None, gpu_s: float, units: int,
                      unit_s: float | None) -> tuple[str | None, float]:
        """Of the first whole units a holder reports after a freezer-governed tenant was frozen for its turn, the
        time beyond its usual units (`unit_s`): that tenant's GPU work still queued at its freeze, which the holder's
        CUDA events timed while waiting behind it (policy.reports' `beside` rule, at most a slice). Not the holder's
        work: the frozen tenant is charged it (`_charge_drain`); a trainer's few queued matmuls (~7 ms) at every
        hand-over are a few points of the GPU. Returns the frozen tenant (None: this report is not the first after a
        freeze) and that time."""
        if held is None or held.frozen_holder is None or units < 1 or gpu_s <= 0:
            return None, 0.0
        frozen, held.frozen_holder = held.frozen_holder, None
        return frozen, beside_excess(gpu_s, units, unit_s, self.slice_s, 0.0)

    def _charge_drain(self, frozen: str, r: Resource, drain_s: float, ended: float, now: float) -> None:
        """Charge the frozen tenant its work that a holder's first units waited behind (`_frozen_drain`), and place it
        in time as reported work, ending where the holder's own began, so the tick does not charge that busy time
        again. Left to the tick's busy time, it would be charged only where the tenant's freeze fell in the same
        interval as the report, which reports up to half a slice late mostly miss."""
        self._reported.setdefault(r, []).append((ended, drain_s))
        if self.policy.has(frozen):  # (it may have been removed since)
            self.policy.charge(frozen, r, drain_s, now, REPORTED_DRAIN)
