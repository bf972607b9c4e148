"""Where a cooperative tenant's reported work lies in time, for LeaseBook: a report arrives with the client's next
renewal, after the work it covers."""

from __future__ import annotations

from unisched.policy import Resource

__all__ = ["MAX_REPORT_LAG_SLICES", "WorkEnds"]

MAX_REPORT_LAG_SLICES = 0.5
"""A contended client reports at least twice a slice (unisched_client.renewals): the last unit a report covers
ended at most this long before it arrived."""


class WorkEnds:
    """Per cooperative tenant and resource, where its reported work ends.

    A report covers the units done since the last one, but the client sends it with its next renewal, so a 28 ms
    frame can have ended 25 ms before its report. Placed at the arrival, that work falls in the next interval: the
    freezer-governed tenant frozen for the holder's turn was charged the interval before in full, and the credit for
    late reports (policy.charging.cooperative_part) found little of it there. The client says how long before the
    report its last unit ended (`ended_ago_s`, by its own clock): the work ended then. Clients that do not say are
    placed back to back from their grant (their last unit past their revoke), which errs early when their first
    unit waited: a render client's first frame of a turn runs after the frozen app's frame in flight, and placed from
    the grant its frames would take that drain off the app's charge at every turn."""

    def __init__(self, slice_s: float) -> None:
        self.slice_s = slice_s
        self._ran_to: dict[tuple[str, Resource], float] = {}

    def granted(self, tenant: str, r: Resource, now: float) -> None:
        """`tenant` was granted `r`: its units start from now."""
        self._ran_to[(tenant, r)] = now

    def end(self, tenant: str, r: Resource, wall_s: float, now: float, ended_ago_s: float = 0.0) -> float:
        """When the work of a report of `wall_s` (its units' timed length) that arrives `now` ended: `ended_ago_s`
        before it where the client said (0: it did not), else the end of the work reported before it plus `wall_s`;
        at most `MAX_REPORT_LAG_SLICES` before the arrival (a holder that idled in its turn), never after it. The
        arrival for a tenant never granted `r` that does not say."""
        lag = MAX_REPORT_LAG_SLICES * self.slice_s
        ran_to = self._ran_to.get((tenant, r))
        if wall_s <= 0:
            return now
        if ended_ago_s > 0:
            end = now - min(ended_ago_s, lag)
        elif ran_to is None:
            return now
        else:
            end = min(now, max(ran_to + wall_s, now - lag))
        self._ran_to[(tenant, r)] = end
        return end

    def drop(self, tenant: str) -> None:
        for key in [k for k in self._ran_to if k[0] == tenant]:
            del self._ran_to[key]
