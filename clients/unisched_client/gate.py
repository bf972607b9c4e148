"""One engine's lease as the app sees it: `acquire()` before a unit of GPU work, `done()` after, `release()`.

Whether a unit may start is decided in one place, `may_start` (a pure function of the gate's lease state and
the time); `Gate.acquire` carries the decision out and waits, and `Gate.granted`/`Gate.revoked` move the lease
state on the daemon's grants and revokes. Everything here runs under the client's lock.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from unisched_wire import unisched_pb2 as pb

if TYPE_CHECKING:
    from unisched_client.client import Client

__all__ = ["START_GRACE_S", "Gate", "Start", "may_start"]

START_GRACE_S = 0.005
"""While others wait for the engine, a unit may still start this long after the slice's end: the daemon's renewal (or
revoke) comes a little after it (its tick, then the message), and a holder that stopped starting units at the end
itself would leave the GPU idle until then at every slice: a few points of the GPU for two clients of short steps
(1.7 ms). The overrun past a slice stays bounded: at most one unit that started within the grace."""
MIN_AGO_S = 1e-6
"""The least `ended_ago_s` a report with GPU time carries: 0 on the wire means "not known"."""


class Start(Enum):
    """The answer to "may my next unit start now?"."""

    JUMP = "jump"
    """Yes, before the grant: the want just sent is granted at once (the last grant said `jump`)."""
    UNGOVERNED = "ungoverned"
    """Yes: no daemon governs us (unreachable with fail_open, or lost until it is back)."""
    HELD = "held"
    """Yes: the lease is held, and nobody else waits for the engine or the slice is not over."""
    WAIT = "wait"
    """No: wait for a grant (or for the next slice's renewal)."""


def may_start(g: Gate, governed: bool, now: float, fresh_want: bool) -> Start:
    """The gate's turn rule. A unit starts only while the lease is held and, when others wait for the engine
    (contended), before the slice ends (or within START_GRACE_S after, while the daemon's next decision is on its
    way): it may run past the slice, never start later, so the overrun is at most one unit however late a
    revocation arrives. A unit queued behind the app's running one starts on the GPU only when that one ends
    (`Gate.busy_until`), so that is when it is taken to start. `fresh_want`: this acquire() just sent the want
    (after a release)."""
    if fresh_want and g.jump and governed and not g.lease:
        return Start.JUMP
    if not governed:
        return Start.UNGOVERNED
    if g.lease and (not g.contended or max(now, g.busy_until) < g.slice_end + START_GRACE_S):
        return Start.HELD
    return Start.WAIT


class Gate:
    """Leases on one engine. `acquire()` before a unit of GPU work, `done(gpu_seconds)` after it.

    A unit starts only while the lease is held and, when others wait for the engine, before the slice ends
    (the daemon's next decision renews the lease or revokes it): see `may_start`. When the lease is
    revoked, the gate says so (yield) once its units are done, or at once when the app already waits in
    `acquire()` for the next one: then its queued unit (one while contended, see `InFlight`) still runs beside
    the next holder's first (measured and charged to their owner, `InFlight.acquire`). Each report counts the units
    it covers, and the daemon gives a compute tenant with long steps turns of several of them (Tuning.run_units), so
    that hand-overs, which two time-sliced CUDA contexts pay for, come once per several steps. Not drained before the
    yield: the next holder would then start late into a slice that ends at the daemon's tick, which costs more than
    the overlap.
    """

    def __init__(self, client: Client, engine: str) -> None:
        self.client = client
        self.engine = engine
        self.lease = 0
        self.contended = False
        self.slice_end = 0.0
        """When the current slice ends: with others waiting, no unit starts after it until the lease is renewed."""
        self.wanting = False
        self.pending_s = 0.0
        self.pending_units = 0
        """Units done since the last report: the daemon learns their length from the two (see LeaseReport.units)."""
        self.used_s = 0.0
        self.last_use = 0.0
        self.done_at = 0.0
        """When the last unit (or part) with GPU time was reported done: the daemon places the pending work in time
        from it (LeaseReport.ended_ago_s), as reports go with renewals, up to half a slice after the work."""
        self.waited_s = 0.0
        """Time app threads spent in acquire() waiting for the lease (a call that timed out included)."""
        self.revokes = 0
        self.blocked = False
        """An app thread waits in acquire(): the engine is wanted even though no unit ran lately."""
        self.open_units = 0
        """Units acquired and not yet reported done (a first CUDA step can take seconds)."""
        self.acquired_at = 0.0
        """When acquire() last let a unit (or part) start: its GPU work starts no earlier (InFlight's estimate)."""
        self.busy_until = 0.0
        """When the GPU work the app already queued is expected to end (InFlight estimates it from the units'
        measured lengths; 0: nothing queued). A unit launched now starts on the GPU only then: without this, a
        50 ms step queued just before the slice's end would run a whole step past it, beside the next holder, where
        the driver time-slices the two."""
        self.owes_yield = False
        self.jump = False
        """The last grant said our wants are granted at once (preemptive mode, online, no other online tenant):
        after a release the next unit starts as it asks, without the want's round trip."""
        self.jumps = 0

    @property
    def held(self) -> bool:
        return self.lease != 0

    def acquire(self, timeout: float | None = None) -> bool:
        """Block until this engine may be used; False on timeout. Passes at once when ungoverned, and, after a
        release, when the last grant said our wants are granted at once (`jump`: the daemon then revokes the
        offline holder as the want arrives, and the grant follows)."""
        c = self.client
        clock = c.clock
        deadline = None if timeout is None else clock.monotonic() + timeout
        with c._cond:
            now = start = clock.monotonic()
            self.last_use = now
            self.blocked = True
            try:
                while True:
                    fresh_want = not self.wanting
                    if fresh_want:
                        self.wanting = True
                        c._send_locked(pb.LeaseRequest(want=pb.LeaseWant(engine=self.engine)))
                    start_as = may_start(self, c.governed, now, fresh_want)
                    if start_as is not Start.WAIT:
                        if start_as is Start.JUMP:
                            self.jump = False  # once per release: the grant (or its absence) says the rest
                            self.jumps += 1
                        elif start_as is Start.HELD:
                            self.waited_s += now - start
                        self.open_units += 1
                        self.acquired_at = now
                        return True
                    if self.owes_yield:
                        self.yield_locked()
                    elif self.pending_s > 0:  # held: the slice is over, charge it before the daemon decides the next;
                        self.flush_locked()  # revoked: a unit that ended after the yield (InFlight.acquire)
                    wait = None if deadline is None else deadline - now
                    if wait is not None and wait <= 0:
                        self.waited_s += now - start  # waited all the same (InFlight.acquire waits in such calls)
                        return False
                    clock.wait(c._cond, wait)
                    now = clock.monotonic()
            finally:
                self.blocked = False
                self.last_use = clock.monotonic()

    def done(self, gpu_seconds: float, units: int = 1) -> None:
        """Report the measured GPU time of the unit just finished (sent with the next renewal). `units=0` for a
        part of a unit that a pause point ended (see `InFlight.split`): timed and charged, not counted as a unit,
        so the daemon still learns the whole step's length."""
        with self.client._cond:
            g = max(0.0, gpu_seconds)
            self.open_units = max(0, self.open_units - 1)
            self.pending_s += g
            self.pending_units += units
            self.used_s += g
            self.last_use = self.client.clock.monotonic()
            if g > 0:
                self.done_at = self.last_use
            if self.owes_yield and not self.open_units:
                self.yield_locked()

    def ending(self) -> bool:
        """Whether the lease was revoked: drain in-flight work now so the next holder starts clean."""
        with self.client._cond:
            return self.client.governed and not self.lease

    def release(self) -> None:
        """No more work on this engine for now: hand it on at once."""
        with self.client._cond:
            if self.wanting:
                self.wanting = False
                self.flush_locked(release=True)  # also the yield of a revoked lease
                self.lease = 0
                self.owes_yield = False

    def __enter__(self) -> Gate:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    # --- the daemon's side (the client's reader thread, under its lock) ---------------------------------
    def granted(self, grant: pb.LeaseGrant, now: float) -> None:
        self.jump = grant.jump  # (a grant that comes after a short unit's release still says if we may jump)
        if self.wanting:
            self.lease = grant.lease
            self.contended = grant.contended
            self.slice_end = now + grant.slice_left_s
            self.owes_yield = False  # held again: the daemon waits for no hand-over from us

    def revoked(self, revoke: pb.LeaseRevoke) -> None:
        # a released gate owes no yield: its release handed the engine on, and a yield would read
        # as a renewal (a want) to the daemon, which would grant the engine again to nobody using it
        if self.wanting and self.lease in (revoke.lease, 0):
            self.jump = False  # revoked while wanted: someone outranks us, wants wait for grants again
            self.lease = 0
            self.revokes += 1
            self.owes_yield = True
            if not self.open_units:
                self.yield_locked()

    def lost_locked(self) -> None:
        """The daemon is gone: no lease, and a restarted daemon may see other online tenants, so wants wait for
        grants until one says otherwise."""
        self.lease = 0
        self.jump = False

    def idle_released_locked(self) -> None:
        """Not used for a while: hand the engine on (the renewals' idle rule decided)."""
        self.wanting = False
        self.lease = 0
        self.owes_yield = False
        self.flush_locked(release=True)

    # --- reports ----------------------------------------------------------------------------------------
    def report_locked(self, release: bool = False, yielded: bool = False) -> pb.LeaseRequest:
        """The pending usage as a report (taken: the next report starts from zero)."""
        s, self.pending_s = self.pending_s, 0.0
        n, self.pending_units = self.pending_units, 0
        ago = max(MIN_AGO_S, self.client.clock.monotonic() - self.done_at) if s > 0 else 0.0
        return pb.LeaseRequest(report=pb.LeaseReport(engine=self.engine, gpu_seconds=s, units=n, release=release,
                                                     yielded=yielded, ended_ago_s=ago))

    def flush_locked(self, release: bool = False, yielded: bool = False) -> None:
        self.client._send_locked(self.report_locked(release, yielded))

    def yield_locked(self) -> None:
        """The revoked lease's last unit is done: report it, and let the daemon hand the engine on."""
        self.owes_yield = False
        self.flush_locked(yielded=True)
