"""Lease enforcement's bookkeeping: lease sessions of cooperative clients, their demand, their leases.

A cooperative tenant is an ordinary tenant (a cgroup with a weight) with at least one lease session open. Its
demand is what its sessions want (renewed within `valid_s`), its charges are the GPU time they report, and
instead of being frozen it is granted and revoked leases from the same decision that freezes and thaws
freezer-governed tenants, so both kinds share a GPU by weight. `LeaseBook` is driven by `Scheduler` (which owns the
policy and the clock); it sends through each session's `LeaseChannel`. Hand-overs between holders and their
measured gap are scheduler.handovers; the minimum runs that long units earn are scheduler.turns; what a report is
charged, and the overruns, are scheduler.lease_charges.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection
from itertools import count

import structlog

from unisched.enforce.leases import LeaseChannel, LeaseGrant, LeaseRevoke
from unisched.policy import ContentionMap, Decision, Engine, Mode, Priority, Resource, WeightedFairShare
from unisched.policy.callers import Caller, Pod
from unisched.policy.leases import OverrunVerdict
from unisched.policy.plan import lease_contended, lease_jump, online_jumps
from unisched.policy.tuning import TUNING
from unisched.scheduler.handovers import Handovers
from unisched.scheduler.lease_charges import LeaseCharges
from unisched.scheduler.lease_records import CoopRecord, LeaseRecord, SessionRecord
from unisched.scheduler.turns import Turns
from unisched.scheduler.workends import WorkEnds

__all__ = ["MAX_REPORT_S", "LeaseBook", "LeaseError"]

log = structlog.get_logger("unisched.scheduler")

MAX_REPORT_S = 60.0
"""GPU seconds one report may carry (a report covers well under a second of work)."""


class LeaseError(Exception):
    """A lease request the engine refuses (invalid input, unknown session)."""


class LeaseBook:
    def __init__(self, policy: WeightedFairShare, contention: ContentionMap, slice_s: float, valid_s: float,
                 max_run_s: float = 0.5) -> None:
        self.policy = policy
        self.contention = contention
        self._resources: dict[tuple[int, Engine], Resource] = {}
        """resource()'s answers: every renewal asks, and the contention map is fixed for the book's life."""
        self.slice_s = slice_s
        self.valid_s = valid_s
        self._sessions: dict[int, SessionRecord] = {}
        self._coop: dict[str, CoopRecord] = {}
        self._ids = count(1)
        self._lease_ids = count(1)
        self._handovers = Handovers(slice_s, self.cooperative)
        self._charges = LeaseCharges(policy, slice_s, self._handovers)
        self._turns = Turns(policy, slice_s, max_run_s)
        self._last_holder: dict[Resource, str] = {}
        """The previous decision's holder of each resource (a grant after a freezer-governed one follows a freeze)."""
        self._work_ends = WorkEnds(slice_s)

    def take_reported(self) -> dict[Resource, list[tuple[float, float]]]:
        """The reports per resource since the last call (LeaseCharges.take_reported)."""
        return self._charges.take_reported()

    # --- queries -----------------------------------------------------------------------------------
    def cooperative(self, tenant: str) -> bool:
        return tenant in self._coop

    def enforced(self, tenant: str) -> bool:
        return self._charges.enforced(tenant)

    def cooperative_names(self) -> Collection[str]:
        """The cooperative tenants (a live read-only view: membership tests without a call per tenant)."""
        return self._coop.keys()

    def enforced_names(self) -> Collection[str]:
        """The tenants whose leases the freezer backs (live; do not modify)."""
        return self._charges.enforced_names()

    def demand(self, tenant: str) -> frozenset[Resource]:
        c = self._coop.get(tenant)
        return c.demand if c else frozenset()

    def holds(self, tenant: str) -> bool:
        c = self._coop.get(tenant)
        return bool(c and c.leases)

    def client_held(self, r: Resource) -> bool:
        """Whether the last decision gave `r` to a cooperative tenant: the GPU's busy time there is its work."""
        return self._last_holder.get(r) in self._coop

    def overrun_s(self, tenant: str) -> float:
        return self._charges.overrun_s(tenant)

    def lease_of(self, tenant: str, sid: int, engine: Engine) -> int | None:
        """The id of the lease covering the session's engine, if the tenant holds it."""
        c = self._coop.get(tenant)
        if c is None or not c.leases:
            return None
        lease = c.leases.get(self.resource(self._session(sid).gpu, engine))
        return lease.id if lease else None

    def session_tenant(self, sid: int) -> str:
        return self._session(sid).tenant

    def resource(self, gpu: int, engine: Engine) -> Resource:
        r = self._resources.get((gpu, engine))
        if r is None:
            (r,) = self.contention.resources((gpu,), {engine})
            self._resources[(gpu, engine)] = r
        return r

    def _session(self, sid: int) -> SessionRecord:
        s = self._sessions.get(sid)
        if s is None:
            raise LeaseError(f"no lease session {sid} (send hello first)")
        return s

    # --- sessions ------------------------------------------------------------------------------------
    def open(self, tenant: str, gpu: int, channel: LeaseChannel, user: Caller | None = None) -> int:
        """`user`: who opens the session (a uid, or a pod whatever uids its processes take), None for an admin. A
        user whose leases were found overrunning has the freezer back the leases of every tenant it opens a session
        in (LeaseCharges.enforce_user)."""
        sid = next(self._ids)
        bound = log.bind(tenant=tenant, session=sid)
        self._sessions[sid] = SessionRecord(sid, tenant, gpu, channel, bound, bound.is_enabled_for(logging.DEBUG),
                                            user=user)
        if user is not None:
            self._charges.enforce_user(user, tenant)
        self._coop.setdefault(tenant, CoopRecord()).sessions.add(sid)
        log.info("lease session opened", tenant=tenant, session=sid, gpu=gpu)
        return sid

    def close(self, sid: int, now: float) -> tuple[str, dict[str, int], bool] | None:
        """Forget a session; returns its tenant, the codec sessions it still had open, and whether the holders
        may change (it held a lease, or the next holder waited for its yield): only then must the engine decide
        again, so a thousand waiting clients disconnecting at once cost no thousand decisions."""
        s = self._sessions.pop(sid, None)
        if s is None:
            return None
        c = self._coop[s.tenant]
        c.sessions.discard(sid)
        log.info("lease session closed", tenant=s.tenant, session=sid)
        self._left(s.user)
        affected = False
        if not c.sessions:
            affected = bool(c.leases)
            for r, lease in list(c.leases.items()):
                self._revoke(s.tenant, c, r, lease, now, "session closed", notify=False)
            del self._coop[s.tenant]
            affected = self._handovers.end_all(s.tenant, now) or affected
            self._handovers.drop(s.tenant)
            self._work_ends.drop(s.tenant)
            self._turns.drop(s.tenant)
        self._refresh_demand(s.tenant, now)
        return s.tenant, dict(s.codec), affected

    def forget_tenant(self, tenant: str) -> None:
        """The tenant is removed: revoke what it holds and drop its sessions."""
        self._charges.forget(tenant)
        self._handovers.drop(tenant)
        self._work_ends.drop(tenant)
        self._turns.drop(tenant)  # (the engine removes it from the policy right after)
        c = self._coop.pop(tenant, None)
        if c is None:
            return
        for sid in c.sessions:
            s = self._sessions.pop(sid)
            self._left(s.user)
            for r, lease in c.leases.items():
                if r.gpu == s.gpu:
                    s.channel.send(LeaseRevoke(lease.id, lease.engine, "tenant removed"))

    def _left(self, user: Caller | None) -> None:
        """A session of `user` ended. A pod whose overruns are on record and that has no session left has its record
        dropped: a pod is keyed by its pid namespace's inode, which the kernel gives the next pod once this one is
        gone, and a record kept would enforce that unrelated pod (a pod that sheds its record this way gains no more
        than making a new pod would; its tenants stay enforced)."""
        if (isinstance(user, Pod) and self._charges.user_enforced(user)
                and not any(o.user == user for o in self._sessions.values())):
            self._charges.forget_user(user)

    def note_codec(self, sid: int, kind: str, delta: int) -> None:
        s = self._session(sid)
        s.codec[kind] = max(0, s.codec.get(kind, 0) + delta)

    def codec_open(self, sid: int, kind: str) -> int:
        return self._session(sid).codec.get(kind, 0)

    # --- demand and usage ----------------------------------------------------------------------------
    def want(self, sid: int, engine: Engine, now: float) -> bool:
        """Demand on an engine (also a renewal). Returns whether the tenant's demand changed."""
        s = self._session(sid)
        s.wants[engine] = now
        s.released.discard(engine)
        return self._refresh_demand(s.tenant, now)

    def report(self, sid: int, engine: Engine, gpu_s: float, release: bool, now: float, yielded: bool = False,
               units: int = 0, ended_ago_s: float = 0.0) -> tuple[bool, OverrunVerdict | None]:
        """Charge measured GPU time (all of it, overrun included); renew, or release the engine. Returns
        whether the schedule may change (demand changed, or a hand-over completed) and the overrun verdict.
        `units`: how many steps or frames the time covers (their length sets the tenant's minimum run);
        `ended_ago_s`: how long before the report its last unit ended, by the client's clock (0: not known)."""
        if not 0.0 <= gpu_s <= MAX_REPORT_S:  # also refuses NaN
            raise LeaseError(f"gpu_seconds must be within 0 .. {MAX_REPORT_S:g}, got {gpu_s!r}")
        if not 0.0 <= ended_ago_s <= MAX_REPORT_S:
            raise LeaseError(f"ended_ago_s must be within 0 .. {MAX_REPORT_S:g}, got {ended_ago_s!r}")
        if units < 0:
            raise LeaseError(f"units must be >= 0, got {units}")
        s = self._session(sid)
        c = self._coop[s.tenant]
        r = self.resource(s.gpu, engine)
        if s.debug:
            s.log.debug("lease report", gpu_s=round(gpu_s, 5), units=units, ago_ms=round(ended_ago_s * 1000, 2),
                        release=release, yielded=yielded, held=r in c.leases, now=round(now, 4))
        thawed_at = self._handovers.beside_freezer(r, s.tenant)  # (before its yield ends the hand-over)
        handed = (release or yielded) and self._handovers.yielded(r, s.tenant, now)
        held = c.leases.get(r)
        if held is not None and held.handed_at is not None and gpu_s > 0:
            self._note_gap(r, now - gpu_s - held.handed_at)
            held.handed_at = None
        unit_s = self._turns.unit_s(s.tenant)  # (this report teaches it only below)
        at = self._work_ends.end(s.tenant, r, gpu_s, now, ended_ago_s)  # when its work ended (reports come later)
        user_was_enforced = s.user is not None and self._charges.user_enforced(s.user)
        verdict, own_s = self._charges.charge(s, c, r, engine, gpu_s, units, unit_s, at, thawed_at, now)
        if s.user is not None and not user_was_enforced and self._charges.user_enforced(s.user):
            for other in self._sessions.values():  # its other tenants, at once
                if other.user == s.user:
                    self._charges.enforce_user(s.user, other.tenant)
        if own_s > 0:
            self._turns.report(s.tenant, own_s, units, lambda: self._longest_gap(s.tenant),
                               earns_run=engine is Engine.COMPUTE)
        elif gpu_s > 0:  # left out of the usual length (after a freeze, or the `learn` rule)
            self._turns.skip(s.tenant, units)
        wanted = engine in s.wants
        if release:
            s.wants.pop(engine, None)
            s.released.add(engine)
        elif yielded and engine in s.released:
            pass  # older clients answer the revoke of their own release with a yield: that is no want
        else:  # a renewal: it still wants the engine (also after a revocation it could not see coming)
            s.wants[engine] = now
            s.released.discard(engine)
        if (engine in s.wants) == wanted:  # the usual renewal: no engine wanted or dropped, so the demand is as it was
            return handed, verdict
        return self._refresh_demand(s.tenant, now) or handed, verdict

    def _note_gap(self, r: Resource, gap_s: float) -> None:
        """A hand-over's measured gap (Handovers.note_gap), and the minimum runs of the cooperative tenants on `r`
        that follow."""
        gap = self._handovers.note_gap(r, gap_s)
        for tenant, c in self._coop.items():
            if r in c.demand or r in c.leases:
                self._turns.regap(tenant, gap)

    def handover_gap_s(self, r: Resource) -> float | None:
        """The mean measured hand-over gap between cooperative holders of `r`, once one was measured."""
        return self._handovers.gap_s(r)

    def _longest_gap(self, tenant: str) -> float:
        c = self._coop.get(tenant)
        gaps = [self._handovers.gap_s(r) or 0.0 for r in (c.demand | set(c.leases))] if c is not None else []
        return max(gaps, default=0.0)

    @property
    def max_run_s(self) -> float:
        """Cap on the minimum run that long units earn (Tuning.run_units); 0 = turns of one slice whatever the units."""
        return self._turns.max_run_s

    def unit_s(self, tenant: str) -> float | None:
        """The tenant's mean unit length, once it reported counted units."""
        return self._turns.unit_s(tenant)

    def min_run_s(self, tenant: str) -> float:
        """The minimum run its units earned (0: turns of a slice)."""
        return self._turns.min_run_s(tenant)

    def _turn_left(self, tenant: str, now: float, slice_left_s: float) -> float:
        """Until the decision that may end the holder's turn: the last tick on the grid before its minimum run ends (or
        the next one). Ticks come late (the daemon's own work, the event loop), so a tick due just before the run ends
        can land after it and end the turn; told the tick after that, a contended client would queue a step that then
        runs whole beside the next holder. Told early costs little: a long unit in flight outlasts the renewal's way, and a short
        one's next start waits within START_GRACE_S of the client's gate."""
        run_left = self.policy.min_run_left(tenant, now)
        if run_left > slice_left_s:
            slice_left_s += math.floor((run_left - slice_left_s) / self.slice_s + 1e-9) * self.slice_s
        return slice_left_s

    def expire(self, now: float, frozen: Callable[[str], bool]) -> None:
        """Drop the wants of lease holders that did not renew within valid_s (their demand and leases go
        with them; the tick's decision follows). Only holders must renew: a waiting client stays silent (its
        stream closing ends its demand), so a thousand waiting tenants cost the daemon nothing. A tenant the
        freezer holds cannot renew: its wants are kept, and count from when it is thawed (`touch`)."""
        changed = []
        for tenant, c in self._coop.items():
            if not c.leases or frozen(tenant):
                continue
            for sid in c.sessions:
                s = self._sessions[sid]
                stale = [e for e, at in s.wants.items()
                         if now - at > self.valid_s and self.resource(s.gpu, e) in c.leases]
                if stale:
                    for e in stale:
                        del s.wants[e]
                    log.warning("lease not renewed; revoked", tenant=s.tenant, session=s.id,
                                engines=sorted(e.value for e in stale), valid_s=self.valid_s)
                    changed.append(tenant)
        for tenant in changed:
            self._refresh_demand(tenant, now, reason="not renewed")

    def touch(self, tenant: str, now: float) -> None:
        """The tenant was just thawed: its wants are fresh from now."""
        c = self._coop.get(tenant)
        if c is not None:
            for sid in c.sessions:
                s = self._sessions[sid]
                for e in s.wants:
                    s.wants[e] = now

    def _engines_on(self, s: SessionRecord, r: Resource) -> list[Engine]:
        """The engines the session wants that the resource covers (compute and graphics are one resource where
        they contend)."""
        if s.gpu != r.gpu:
            return []
        return [e for e in s.wants if self.contention.domain(e) == r.domain]

    def _touch_resource(self, c: CoopRecord, r: Resource, now: float) -> None:
        for sid in c.sessions:
            s = self._sessions[sid]
            for e in self._engines_on(s, r):
                s.wants[e] = now

    def _refresh_demand(self, tenant: str, now: float, reason: str = "released") -> bool:
        c = self._coop.get(tenant)
        demand: frozenset[Resource] = frozenset()
        if c is not None:
            demand = frozenset(
                self.resource(self._sessions[sid].gpu, e) for sid in c.sessions for e in self._sessions[sid].wants
            )
            for r, lease in list(c.leases.items()):
                if r not in demand:
                    self._revoke(tenant, c, r, lease, now, reason)
            if demand == c.demand:
                return False
            c.demand = demand
        self.policy.set_demand(tenant, demand)
        return True

    # --- decisions -----------------------------------------------------------------------------------
    def apply(self, decision: Decision, now: float, slice_left_s: float, tick: bool,
              mixed: frozenset[Resource] = frozenset()) -> None:
        """Grant the decision's holders their engines and revoke the rest. On a tick every holder hears
        again (how long the new slice is); between ticks only those whose lease or contention changed.
        `mixed`: resources that take turns with the other side of a partly overlapping pair (policy.overlap): a
        holder there is revoked when its side sits out, so it is told it is contended (one unit in flight)."""
        holders = decision.holders
        preemptive = self.policy.config.mode is Mode.PREEMPTIVE
        online_gpus: set[int] | None = None
        online: frozenset[str] | None = None
        for tenant, c in self._coop.items():  # revokes first: a grant must see the hand-over they start
            for r, held in list(c.leases.items()):
                if holders.get(r) != tenant and r in c.demand:
                    self._revoke(tenant, c, r, held, now, "slice over")
        for r, holder in holders.items():  # a freezer-governed holder is thawed at once, beside the revoked tail
            h = self._handovers.get(r)
            if h is not None and h.overlap is None and holder not in self._coop:
                self._handovers.overlap(r, holder, now)
        before, self._last_holder = self._last_holder, dict(holders)
        for tenant, c in self._coop.items():
            for r in c.demand:
                if holders.get(r) != tenant:
                    continue
                lease = c.leases.get(r)
                prio = self.policy.priority(tenant)
                wanting, is_mixed = self.policy.contenders(r), r in mixed
                beside = False
                if not lease_contended(wanting, is_mixed, False) and preemptive and prio is not Priority.ONLINE:
                    if online_gpus is None:  # found once, when an offline holder needs it
                        online_gpus = self._online_gpus()
                    beside = r.gpu in online_gpus
                contended = lease_contended(wanting, is_mixed, beside)
                if preemptive and prio is Priority.ONLINE and online is None:  # found once, when needed
                    online = frozenset(n for n in self.policy.names() if self.policy.priority(n) is Priority.ONLINE)
                jump = lease_jump(preemptive, prio, online or frozenset(), tenant)
                h = self._handovers.get(r) if lease is None else None
                if h is not None:
                    if h.tenant == tenant or now >= h.deadline:
                        self._handovers.end(r, now)
                    elif self._jumps(tenant, h.tenant, now):
                        self._handovers.overlap(r, tenant, now)  # granted beside the offline tail, which still drains
                        log.debug("lease overlap", tenant=tenant, draining=h.tenant, resource=str(r))
                    else:
                        continue  # the previous holder is finishing its unit: grant once it yields
                if lease is None:
                    engine = self._engine_of(c, r)
                    yielded = self._handovers.take_yield(r)
                    direct = yielded is not None and now - yielded <= TUNING.handover_grant_slices * self.slice_s
                    last = before.get(r)
                    lease = c.leases[r] = LeaseRecord(next(self._lease_ids), engine, contended,
                                                 handed_at=yielded if direct else None,
                                                 frozen_holder=last if last is not None and last not in self._coop else None)
                    self._work_ends.granted(tenant, r, now)
                    self._handovers.granted(r, tenant)
                    log.debug("lease granted", tenant=tenant, lease=lease.id, resource=str(r), contended=contended,
                              slice_left_s=round(self._turn_left(tenant, now, slice_left_s), 4), now=round(now, 4))
                    self._charges.meter(c, r).hold(now)
                    self._touch_resource(c, r, now)  # renewals are due from the grant on
                elif not tick and contended == lease.contended and jump == lease.jump:
                    continue
                lease.contended, lease.jump = contended, jump
                lease.slice_left_s = self._turn_left(tenant, now, slice_left_s)
                self._send(c, r, lease)

    def _online_gpus(self) -> set[int]:
        """GPUs with an online cooperative tenant connected. In preemptive mode an offline holder there may be
        preempted at any moment, so it is told it is contended: it keeps one unit in flight (and reports often),
        and a request waits on less of its queued work (unisched_client._inflight)."""
        priority = self.policy.priority
        return {self._sessions[sid].gpu for tenant, c in self._coop.items() if priority(tenant) is Priority.ONLINE
                for sid in c.sessions}

    def _engine_of(self, c: CoopRecord, r: Resource) -> Engine:
        for sid in c.sessions:
            for e in self._engines_on(self._sessions[sid], r):
                return e
        raise AssertionError("a demanded resource has a wanting session")

    def _send(self, c: CoopRecord, r: Resource, lease: LeaseRecord, reason: str | None = None) -> None:
        """A grant (reason None) or a revoke to every session of the tenant on that GPU, once per engine
        of theirs the resource covers (compute and graphics are one resource where they contend)."""
        for sid in c.sessions:
            s = self._sessions[sid]
            if s.gpu != r.gpu:
                continue
            engines = self._engines_on(s, r)
            if reason is None:
                for e in engines:
                    s.channel.send(LeaseGrant(lease.id, e, self.valid_s, lease.contended, lease.slice_left_s,
                                              lease.jump))
            else:
                for e in engines or [lease.engine]:
                    s.channel.send(LeaseRevoke(lease.id, e, reason))

    def _revoke(self, tenant: str, c: CoopRecord, r: Resource, lease: LeaseRecord, now: float, reason: str,
                notify: bool = True) -> None:
        del c.leases[r]
        self._handovers.stop_overlap(r, tenant, now)
        if reason == "slice over" and notify:  # it may be mid-unit: the next holder waits for its yield
            self._handovers.start(r, tenant, now)
        log.debug("lease revoked", tenant=tenant, lease=lease.id, resource=str(r), reason=reason, now=round(now, 4))
        self._charges.meter(c, r).drop(now)
        if notify:
            self._send(c, r, lease, reason)

    # --- hand-overs in preemptive mode: online tenants do not wait for offline tails (scheduler.handovers) ---
    def _jumps(self, tenant: str, draining: str, now: float) -> bool:
        """Whether `tenant` is granted at once while `draining` (revoked) finishes its units in flight: only
        an online tenant after an offline one, in preemptive mode. Elsewhere (shared, timeshare, tidal; online
        after online, offline after offline) the next holder waits for the yield, so neither pays for the
        other's tail."""
        if self.policy.config.mode is not Mode.PREEMPTIVE or draining not in self._coop:
            return False
        a, b = self.policy.stats(now, (tenant, draining))  # sorted by name; two tenants: cheap
        prio = {a.name: a.priority, b.name: b.priority}
        return online_jumps(True, prio[tenant], prio[draining])
