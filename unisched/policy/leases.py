"""Lease accounting for lease enforcement: what a cooperative tenant reports against the time it held a lease.

Pure (time passed in). A cooperative client measures its own GPU time and reports it; the daemon charges all
of it (overrun included) and compares it, window by window, with the wall time the tenant held the lease.
GPU time cannot exceed held time by more than the work in flight at a hand-over, so `slack_s` (a slice) is
allowed per window; a tenant over that in `strikes_to_enforce` windows in a row keeps running past its
revocations, and freezer enforcement (the freezer) then backs its leases.
Held time a window's reports did not use is carried into the next window (up to one window): a report of work
done late in one window can arrive in the next, and on a loaded 2-core machine that delay jitter alone made an
honest client look over by more than the slack. An overrunner gains at most that
one window of credit: a window it overruns leaves none.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverrunMeter", "OverrunVerdict"]


@dataclass(frozen=True)
class OverrunVerdict:
    """One evaluated window."""

    overrun_s: float
    """Reported GPU time beyond held time plus slack, in this window (0 when within)."""
    strikes: int
    enforce: bool


class OverrunMeter:
    def __init__(self, window_s: float, slack_s: float, strikes_to_enforce: int = 3) -> None:
        if window_s <= 0 or slack_s < 0 or strikes_to_enforce < 1:
            raise ValueError("window_s > 0, slack_s >= 0 and strikes_to_enforce >= 1 are required")
        self.window_s = window_s
        self.slack_s = slack_s
        self.strikes_to_enforce = strikes_to_enforce
        self.held_since: float | None = None
        self.strikes = 0
        self.overrun_total_s = 0.0
        self._held_s = 0.0
        self._reported_s = 0.0
        self._credit_s = 0.0  # held time earlier windows' reports left unused, at most one window
        self._window_start: float | None = None

    @property
    def held(self) -> bool:
        return self.held_since is not None

    def hold(self, now: float) -> None:
        if self.held_since is None:
            self.held_since = now
        if self._window_start is None:
            self._window_start = now

    def drop(self, now: float) -> None:
        if self.held_since is not None:
            self._held_s += max(0.0, now - self.held_since)
            self.held_since = None

    def report(self, gpu_s: float, now: float) -> OverrunVerdict | None:
        """Add reported GPU time; returns a verdict when a window closes."""
        self._reported_s += gpu_s
        if self._window_start is None:
            self._window_start = now
        if now - self._window_start < self.window_s:
            return None
        held = self._held_s
        if self.held_since is not None:
            held += max(0.0, now - self.held_since)
            self.held_since = now
        over = max(0.0, self._reported_s - held - self._credit_s - self.slack_s)
        self._credit_s = min(self.window_s, max(0.0, held + self._credit_s - self._reported_s))
        self._held_s = 0.0
        self._reported_s = 0.0
        self._window_start = now
        if over > 0:
            self.strikes += 1
            self.overrun_total_s += over
        else:
            self.strikes = 0
        return OverrunVerdict(over, self.strikes, self.strikes >= self.strikes_to_enforce)
