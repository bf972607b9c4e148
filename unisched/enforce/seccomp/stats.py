"""What a seccomp supervisor reports: the books' counts, and how it has been answering."""

from __future__ import annotations

import collections
from dataclasses import dataclass

from unisched.enforce.seccomp.accounting import Counts

__all__ = ["HookCounts", "SupervisorStats", "Tally", "percentile_us"]


@dataclass(frozen=True)
class SupervisorStats(Counts):
    """The books' counts, and how the supervisor has been answering."""

    tenant: str
    notifications: int
    """Notifications answered or skipped."""
    skipped: int
    """Notifications that were gone before the answer (killed or interrupted callers)."""
    errors: int
    """Notifications answered "continue" because handling them failed."""
    latency_p50_us: float | None
    latency_p99_us: float | None
    """Answer latency (notification received -> answer sent), over the most recent samples."""
    latency_samples: int
    closed: bool
    asked_loop: int = 0
    """Session calls whose decision was asked on the event loop (`attach`); every other call was answered by
    the supervisor's thread alone."""
    pending: int = 0
    """Session calls waiting for the loop's decision now."""
    sync_wake_up: bool = False
    """Whether the kernel wakes supervisor and caller on each other's CPU (SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)."""
    paced: int = 0
    """Notifications that waited for their turn of the listener's budget (budget.py) before they were taken."""
    foreign: bool = False
    """The listener notified a call the daemon's filter never sends and was let go of (examine.Foreign)."""


@dataclass(frozen=True)
class HookCounts:
    """How a tenant's hooked calls have been answered: cheap running totals (no samples to sort), read for every
    metrics refresh. The mean time to an answer over an interval is the rise of `answer_s` over that of `calls`."""

    tenant: str
    calls: int
    """Notifications answered or skipped."""
    errors: int
    """Notifications answered "continue" because handling them failed."""
    answer_s: float
    """Seconds from each notification's receipt to its answer's SEND call, summed over `calls` (a call found gone
    counts the time to finding it so): the daemon's own part of the caller's wait."""
    decided: int = 0
    """Of `calls`, the new sessions the daemon's event loop decided (admission against the caps): only these wait
    for the loop, so a loop slow to come round shows in their time alone."""
    decided_s: float = 0.0
    """Of `answer_s`, the time to the answers of the `decided` calls."""
    send_s: float = 0.0
    """Seconds in the answers' SEND calls, summed: the kernel's wake-up of the caller and, with sync wake-up,
    whatever the caller ran on the daemon's CPU before the call returned (its wait had ended by then)."""
    paced: int = 0
    """Of `calls`, those that waited for their turn of the budget (budget.py) before the daemon took them."""
    paced_s: float = 0.0
    """The time they waited, summed: not part of `answer_s` (the daemon had not taken them yet)."""

    def plus(self, other: HookCounts) -> HookCounts:
        """These totals and `other`'s (the same tenant's other listeners)."""
        return HookCounts(self.tenant, self.calls + other.calls, self.errors + other.errors,
                          self.answer_s + other.answer_s, self.decided + other.decided,
                          self.decided_s + other.decided_s, self.send_s + other.send_s,
                          self.paced + other.paced, self.paced_s + other.paced_s)


def percentile_us(samples_ns: list[int], p: float) -> float | None:
    """The p-th fraction of sorted nanosecond samples, in microseconds; None without samples."""
    if not samples_ns:
        return None
    return samples_ns[min(len(samples_ns) - 1, int(p * len(samples_ns)))] / 1000.0


class Tally:
    """A supervisor's running numbers of its answers, changed and read under the supervisor's lock: the totals
    `counts` reports, and the recent latencies `stats` sorts."""

    def __init__(self, latency_window: int) -> None:
        self.notifications = 0
        """Notifications answered or skipped: counted before each answer, so exact by the time the caller resumes."""
        self.skipped = 0
        self.errors = 0
        self.asked = 0
        """Session calls whose decision was asked on the event loop."""
        self.latency_ns: collections.deque[int] = collections.deque(maxlen=latency_window)
        self.answer_ns = 0
        """Every answer's latency summed, where `latency_ns` keeps only the recent ones."""
        self.decided = 0
        self.decided_ns = 0
        """Of those, the answers the event loop decided, and their latency summed."""
        self.send_ns = 0
        """The answers' SEND calls summed, apart from their latency (Listener.send_ns: partly the callers' time)."""
        self.waits = 0
        self.waited_s = 0.0
        """Notifications that waited for their turn of the budget, and how long, summed."""

    def answered(self, latency_ns: int, send_ns: int, answered: bool, decided: bool) -> None:
        """One answer (or a call found gone: not `answered`)."""
        self.latency_ns.append(latency_ns)
        self.answer_ns += latency_ns
        self.send_ns += send_ns
        if decided:
            self.decided += 1
            self.decided_ns += latency_ns
        self.skipped += not answered

    def paced(self, waited_s: float) -> None:
        """One notification that waited `waited_s` for its turn of the budget."""
        self.waits += 1
        self.waited_s += waited_s

    def counts(self, tenant: str) -> HookCounts:
        return HookCounts(tenant, self.notifications, self.errors, self.answer_ns / 1e9, self.decided,
                          self.decided_ns / 1e9, self.send_ns / 1e9, self.waits, self.waited_s)

    def stats(self, tenant: str, books: Counts, pending: int, closed: bool, sync_wake_up: bool,
              foreign: bool = False) -> SupervisorStats:
        """The supervisor's stats: its `books`' counts, these numbers and the recent answers' percentiles."""
        samples = sorted(self.latency_ns)
        return SupervisorStats(
            live=books.live, objects=books.objects, admitted=books.admitted, refused=books.refused, tenant=tenant,
            notifications=self.notifications, skipped=self.skipped, errors=self.errors,
            latency_p50_us=percentile_us(samples, 0.50), latency_p99_us=percentile_us(samples, 0.99),
            latency_samples=len(samples), closed=closed, asked_loop=self.asked, pending=pending,
            sync_wake_up=sync_wake_up, paced=self.waits, foreign=foreign)
