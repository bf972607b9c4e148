"""Once a second, off the slices' path: the timer slack of the threads of the charged tenants that render
(`timer_slack_us`; enforce.timerslack says why). Only those: the GL driver's wait is the loop it helps, and a compute
or video tenant (a training job, an inference service) would only get later timers. Cooperative tenants are left
alone too: they report their GPU time, their CPU is not charged, and their lease renewals would wait on every
timer."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog

from unisched.enforce.timerslack import MAX_THREADS_A_SWEEP, SlackSweep
from unisched.policy import Engine
from unisched.scheduler.context import Context
from unisched.scheduler.tick import charged_cgroups

__all__ = ["SLACK_EVERY_S", "Swept", "note", "slack_ns", "sweeper"]

log = structlog.get_logger("unisched.scheduler")

SLACK_EVERY_S = 1.0
"""How often the threads are swept: a thread started since waits at most this long (its process's first threads
inherit the slack of none; later ones inherit it from the thread that makes them)."""
Swept = list[tuple[str, SlackSweep]]
"""(tenant, what its sweep did), in sweep order."""


def slack_ns(c: Context) -> int:
    """The timer slack the rendering tenants' threads get, in ns; 0: the sweeps are off."""
    return max(0, round(c.config.timer_slack_us * 1000))


def sweeper(c: Context) -> Callable[[], Swept] | None:
    """The next sweep as one call for a worker thread, touching only /proc and the cgroup files; None when
    `timer_slack_us` is 0. Each sweep starts one tenant further down the list and looks at MAX_THREADS_A_SWEEP
    threads at most, so that tenants with many threads neither stall the others nor the thread that sweeps."""
    ns, slack = slack_ns(c), c.thread_slack
    if not ns:
        return None
    pairs = [(name, cg) for name, cg in charged_cgroups(c) if Engine.GRAPHICS in c.tenants[name].all_engines()]
    start = c.slack_from % len(pairs) if pairs else 0
    c.slack_from = start + 1
    order: Sequence[tuple[str, str]] = pairs[start:] + pairs[:start]

    def sweep() -> Swept:
        swept: Swept = []
        left = MAX_THREADS_A_SWEEP
        for name, cgroup in order:
            if left <= 0:
                break
            s = slack.settle(cgroup, ns, left)
            left -= s.set + s.already + s.gone + s.refused
            swept.append((name, s))
        return swept

    return sweep


def note(c: Context, swept: Swept) -> None:
    """Log what a sweep did: threads given the slack at debug, refusals (the daemon lacks CAP_SYS_NICE) as a
    warning at most once a minute."""
    slack_us = c.config.timer_slack_us
    for name, s in swept:
        if s.set:
            log.debug("timer slack set", tenant=name, threads=s.set, slack_us=slack_us, left=s.left)
        if s.refused and (held := c.slack_refusals.allow("refused")) is not None:
            log.warning("cannot set the timer slack of a tenant's threads (the daemon needs CAP_SYS_NICE)",
                        tenant=name, threads=s.refused, later_refusals_not_logged=held)
