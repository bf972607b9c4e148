"""When the renew thread speaks: renewals of held leases (with the usage measured since) and idle releases.

The lease the daemon grants is valid for `valid_s` and the slices are `slice_s` long (both from the welcome).
A holder renews well inside the validity; a contended holder reports more often, because its charges decide the
next slice. A gate not used for a while is released so that the engine is not held for nobody.
"""

from __future__ import annotations

from dataclasses import dataclass

from unisched_client.gate import Gate

__all__ = ["IDLE_CAP_S", "Timing", "renew_locked", "timing"]

IDLE_CAP_S = 30.0
"""A gate with a unit acquired but never reported done is released after this long without use."""
UNCONTENDED_RENEWS_PER_TERM = 3
"""Renewals per lease term when nobody else waits: two may be lost or late before the lease runs out."""
CONTENDED_RENEWS_PER_TERM = 4
CONTENDED_REPORTS_PER_SLICE = 2
"""While contended: a report at least twice a slice (and four times a term), so the daemon decides each slice
on charges at most half a slice old."""
IDLE_SLICES = 4
IDLE_TERM_FRACTION = 0.5
"""A gate unused for four slices (or half a term, when longer) is released, unless a unit is still open."""


@dataclass(frozen=True)
class Timing:
    """The renew thread's timing for one round, from the daemon's welcome and the Client's overrides."""

    interval_s: float
    """How long the renew thread waits before its next round."""
    idle_s: float
    """Unused for longer than this, a gate with no unit open is released."""


def timing(slice_s: float, valid_s: float, contended: bool, interval_s: float | None = None,
           idle_s: float | None = None) -> Timing:
    """Contended holders report often (their charges decide the next slice); others just renew."""
    if not interval_s:
        interval_s = (min(slice_s / CONTENDED_REPORTS_PER_SLICE, valid_s / CONTENDED_RENEWS_PER_TERM) if contended
                      else valid_s / UNCONTENDED_RENEWS_PER_TERM)
    return Timing(interval_s, idle_s or max(IDLE_SLICES * slice_s, IDLE_TERM_FRACTION * valid_s))


def renew_locked(gates: list[Gate], now: float, idle_s: float) -> None:
    """One round (under the client's lock, while governed): release idle gates, renew the held ones with their
    pending usage; a gate waiting for a grant stays silent."""
    for g in gates:
        if not g.wanting:
            continue
        idle = now - g.last_use
        if not g.blocked and ((idle > idle_s and not g.open_units) or idle > IDLE_CAP_S):
            g.idle_released_locked()
        elif g.lease or g.pending_s > 0:
            g.flush_locked()
