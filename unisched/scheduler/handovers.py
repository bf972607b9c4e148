"""Hand-overs between cooperative holders of one resource, for LeaseBook: the revoked holder finishing its unit
in flight, the overlap an online tenant runs beside an offline tail (and the credit that charges it once), and
the measured gap between a holder's yield and the next holder's first work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unisched.policy import Resource
from unisched.policy.tuning import TUNING

__all__ = ["Handover", "Handovers"]


@dataclass
class Handover:
    """A revoked holder finishing its unit in flight on a resource: the next holder waits for its yield (or
    the deadline), except an online tenant in preemptive mode after an offline holder: it is granted at once
    and runs beside the offline tail (`overlap`, since `since`), which the GPU time-slices."""

    tenant: str
    deadline: float
    overlap: str | None = None
    since: float = 0.0


class Handovers:
    """The hand-overs in flight per resource, the overlap credits and the hand-over gaps. `cooperative(tenant)`
    says whether a tenant still has lease sessions: only those are credited an overlap."""

    def __init__(self, slice_s: float, cooperative: Callable[[str], bool]) -> None:
        self.slice_s = slice_s
        self._cooperative = cooperative
        self._pending: dict[Resource, Handover] = {}
        """Resources whose revoked holder is finishing its unit (who, and when to stop waiting for it)."""
        self._credit: dict[tuple[str, Resource], float] = {}
        """GPU seconds of overlap a tenant reported that the other tenant of the overlap also reported: taken
        off its next charges, so the overlap's wall time is charged once in all, half to each."""
        self._tails: dict[tuple[str, Resource], float] = {}
        """A revoked holder that yielded beside a freezer-governed tenant thawed for its turn: when that tenant was
        thawed. Where its app already waited for the next unit, it yielded at once and its unit in flight still runs,
        reported after the yield (unisched_client's InFlight.acquire). Kept until the holder's next grant."""
        self._yielded: dict[Resource, float] = {}
        """When a revoked holder last yielded each resource (the hand-over gap counts from then)."""
        self._gap_s: dict[Resource, float] = {}
        """Per resource, the mean time the GPU waited at a hand-over between two cooperative holders."""

    # --- hand-overs in flight ------------------------------------------------------------------------
    def get(self, r: Resource) -> Handover | None:
        return self._pending.get(r)

    def start(self, r: Resource, tenant: str, now: float) -> None:
        """`tenant` was revoked at the end of its slice and may be mid-unit: the next holder waits for its yield,
        at most a slice."""
        self.end(r, now)
        self._pending[r] = Handover(tenant, now + self.slice_s)

    def yielded(self, r: Resource, tenant: str, now: float) -> bool:
        """`tenant` released or yielded `r`: whether that completed its hand-over (the next holder may go)."""
        h = self._pending.get(r)
        if h is None or h.tenant != tenant:
            return False
        if h.overlap is None:
            self._yielded[r] = now
        elif not self._cooperative(h.overlap):
            self._tails[(tenant, r)] = h.since
        self.end(r, now)  # first: an overlap it ends is credited against the very report that yielded
        return True

    def take_yield(self, r: Resource) -> float | None:
        """When the holder before last yielded `r`, for the lease granted now (None: no yield waiting)."""
        return self._yielded.pop(r, None)

    def end(self, r: Resource, now: float) -> None:
        h = self._pending.pop(r, None)
        if h is not None and h.overlap is not None:
            self._end_overlap(r, h, now)

    def end_all(self, tenant: str, now: float) -> bool:
        """End the hand-overs `tenant` was draining; whether there were any."""
        mine = [r for r, h in self._pending.items() if h.tenant == tenant]
        for r in mine:
            self.end(r, now)
        return bool(mine)

    # --- overlaps in preemptive mode: online tenants do not wait for offline tails ---------------------
    def overlap(self, r: Resource, tenant: str, now: float) -> None:
        """`tenant` runs on `r` at once, beside the revoked tail that still drains it: an online tenant granted at
        once, or a freezer-governed tenant thawed for its turn (the freezer does not wait for a client's yield).
        Two cooperative sides both measure the overlap's wall time (a CUDA event times the other's work the GPU
        time-slices in), so each is credited half of it. Beside a freezer-governed side, the tail's own reports
        say how much of their time was the other's (`beside_freezer`, policy.reports): that side is charged the
        busy time less the client's own work (policy.charging.cooperative_part)."""
        h = self._pending[r]
        h.overlap, h.since = tenant, now

    def beside_freezer(self, r: Resource, tenant: str) -> float | None:
        """When a freezer-governed tenant was thawed on `r` beside `tenant`'s revoked tail, while that tail still
        drains, or after its yield until its next grant (None: neither)."""
        h = self._pending.get(r)
        if h is None or h.tenant != tenant or h.overlap is None or self._cooperative(h.overlap):
            return self._tails.get((tenant, r))
        return h.since

    def granted(self, r: Resource, tenant: str) -> None:
        """`tenant` holds `r` again: what it reports now ran in its turn, not in a tail beside a thawed tenant."""
        self._tails.pop((tenant, r), None)

    def stop_overlap(self, r: Resource, tenant: str, now: float) -> None:
        """`tenant` stopped holding `r`: the overlap it ran there, if any, ends."""
        h = self._pending.get(r)
        if h is not None and h.overlap == tenant:
            self._end_overlap(r, h, now)

    def _end_overlap(self, r: Resource, h: Handover, now: float) -> None:
        """The online tenant stopped holding, or the offline tail yielded (or ran out its slice): both measured
        the overlap's wall time (each one's GPU timer runs while the GPU time-slices the other's work), so each
        is credited half of it and the overlap is charged once in all. Within a class shares stay by weight.
        Beside a freezer-governed tenant nothing is credited: the tail's reports were split as they came."""
        assert h.overlap is not None
        half = max(0.0, min(now, h.deadline) - h.since) / 2
        if not self._cooperative(h.overlap):
            h.overlap = None
            return
        for who in (h.tenant, h.overlap):
            if self._cooperative(who) and half > 0:
                key = (who, r)
                self._credit[key] = min(self.slice_s, self._credit.get(key, 0.0) + half)
        h.overlap = None

    def less_credit(self, tenant: str, r: Resource, gpu_s: float) -> float:
        """`gpu_s` less the overlap credit `tenant` has on `r` (which it uses up)."""
        credit = self._credit.get((tenant, r))
        if not credit:
            return gpu_s
        taken = min(credit, gpu_s)
        if credit > taken:
            self._credit[(tenant, r)] = credit - taken
        else:
            del self._credit[(tenant, r)]
        return gpu_s - taken

    def drop(self, tenant: str) -> None:
        """Forget what is kept for `tenant` (its sessions ended, or it was removed)."""
        for key in [k for k in self._credit if k[0] == tenant]:
            del self._credit[key]
        for key in [k for k in self._tails if k[0] == tenant]:
            del self._tails[key]

    # --- the hand-over gap ---------------------------------------------------------------------------
    def note_gap(self, r: Resource, gap_s: float) -> float:
        """A hand-over's measured gap (from the yield to the next holder's first work, at most a slice: longer is
        the app's own pause, not the hand-over's); returns the new mean gap on `r`."""
        gap_s = min(self.slice_s, max(0.0, gap_s))
        old = self._gap_s.get(r)
        self._gap_s[r] = gap = gap_s if old is None else old + TUNING.unit_ewma * (gap_s - old)
        return gap

    def gap_s(self, r: Resource) -> float | None:
        """The mean measured hand-over gap between cooperative holders of `r`, once one was measured."""
        return self._gap_s.get(r)
