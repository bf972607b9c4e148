"""The timer slack of a tenant's threads (`timer_slack_us`): how late the kernel may fire their timers, so that a GPU
driver's sleeping wait turns less often.

Why: a governed process's GL driver waits for the GPU in a loop of usleep(0) (policy.waits). Each turn sleeps for
about the thread's timer slack (50 us by default), so a player that waits behind many others turns its loop thousands
of times a second, and the CPU those turns cost is charged as GPU time (policy.charging). The players that wait most,
the heaviest weights, pay most. A slack of a millisecond makes each turn sleep about that long: a wait costs a few
turns, and CPU time follows work again. Every timer of those threads (sleeps, poll and timed waits) may then fire up
to that much later, so it is the operator's choice, off by default.

Only the threads of tenants that render are given it (scheduler.slack). A thread's slack is set through
/proc/TID/timerslack_ns (root: CAP_SYS_NICE). Threads inherit it from the thread that creates them, so once a
process's threads carry it, its later threads and children do too; a sweep (once a second, off the engine's loop)
sets it on the threads of the cgroup that do not have it yet. The tid comes from the cgroup's thread list and may be
reused by another process before the write: the write goes through a handle on /proc/TID opened first, on which the
thread is checked to be in the cgroup (or below it) still (a handle on a thread that exited fails, it never names
the tid's next owner). A sweep looks at `most` threads at most (MAX_THREADS_A_SWEEP among all the tenants:
scheduler.slack), in the order the cgroups list them: a tenant that had more than that when it came has the rest of
them left as they were (the threads it makes later inherit the slack from the ones it had). Nothing sets it back:
threads keep it when their tenant is dropped or the daemon stops, as they keep what it set in their environment.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Final, Protocol

from unisched.enforce.cgroups import CgroupDriver, path_in, within
from unisched.enforce.cgtree import folders_below

__all__ = ["MAX_THREADS_A_SWEEP", "FakeThreadSlack", "ProcThreadSlack", "SlackSweep", "ThreadSlack", "settle_thread"]

MAX_THREADS_A_SWEEP: Final = 4096
"""Threads one sweep looks at, all the tenants' together: tenants that make thousands of threads cost the thread
that sweeps no more than this a second (each look is three small /proc reads)."""
_THREADS_FILE: Final = {"v2": "cgroup.threads", "v1": "tasks"}
_READ_MAX: Final = 4096


@dataclass(frozen=True)
class SlackSweep:
    """What one sweep of a cgroup's threads did."""

    set: int = 0
    """Threads given the slack."""
    already: int = 0
    """Threads that had it."""
    gone: int = 0
    """Threads that exited, or left the cgroup, between the list and the write: nothing written."""
    refused: int = 0
    """Writes the kernel refused (the daemon without CAP_SYS_NICE, or a thread it may not touch)."""
    left: int = 0
    """Threads beyond the sweep's bound, for the next sweep."""


class ThreadSlack(Protocol):
    def settle(self, cgroup: str, slack_ns: int, most: int) -> SlackSweep:
        """Give the threads of `cgroup` (and of the cgroups below it) that lack it a timer slack of `slack_ns`,
        looking at `most` threads at most."""
        ...


class ProcThreadSlack:
    """Through /proc, for the cgroups of `driver` (see the module docstring)."""

    def __init__(self, driver: CgroupDriver) -> None:
        self._driver = driver

    def settle(self, cgroup: str, slack_ns: int, most: int) -> SlackSweep:
        tids = self._threads(cgroup, most)
        counts = dict.fromkeys(("set", "already", "gone", "refused"), 0)
        for tid in tids[:most]:
            counts[settle_thread(tid, cgroup, self._driver.kind, slack_ns)] += 1
        return SlackSweep(**counts, left=max(0, len(tids) - most))

    def _threads(self, cgroup: str, most: int) -> list[int]:
        """The threads of `cgroup` and of the cgroups below it (a pod's containers sit below the pod's), up to one
        more than the bound, from `most` cgroups at most (a delegated tenant may make many); none when the cgroup
        is gone (its tenant is, or will be, dropped)."""
        name = _THREADS_FILE.get(self._driver.kind)
        if name is None:
            return []
        tids: list[int] = []
        for folder in folders_below(f"{self._driver.mount}/{cgroup.lstrip('/')}", most):
            if len(tids) > most:
                break
            try:
                with open(f"{folder}/{name}", "rb") as f:
                    tids.extend(int(t) for t in f.read().split())
            except (OSError, ValueError):
                continue  # removed meanwhile
        return tids


def settle_thread(tid: int, cgroup: str, kind: str, slack_ns: int) -> str:
    """Give thread `tid` the slack if it is in `cgroup` (or below it) in the hierarchy of a `kind` driver, checked on
    the handle the write goes through: "set", "already", "gone" (not there, or not in the cgroup) or "refused"."""
    try:
        task = os.open(f"/proc/{tid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return "gone"
    try:
        now_in = path_in(_read_at(task, "cgroup").decode(errors="replace"), kind)
        if now_in is None or not within(now_in, cgroup):
            return "gone"
        if int(_read_at(task, "timerslack_ns")) == slack_ns:
            return "already"
        fd = os.open("timerslack_ns", os.O_WRONLY | os.O_CLOEXEC, dir_fd=task)
        try:
            os.write(fd, str(slack_ns).encode())
        finally:
            os.close(fd)
        return "set"
    except PermissionError:
        return "refused"
    except OSError as e:
        return "refused" if e.errno == errno.EPERM else "gone"  # ESRCH: it exited after the open
    except ValueError:
        return "gone"
    finally:
        os.close(task)


def _read_at(task: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=task)
    try:
        return os.read(fd, _READ_MAX)
    finally:
        os.close(fd)


class FakeThreadSlack:
    """For engine tests: each cgroup has `threads` threads (1 unless named), each sweep sets them all;
    `refuse`: cgroups whose writes the kernel refuses. `swept` records each sweep (cgroup, slack, most)."""

    def __init__(self, threads: dict[str, int] | None = None, refuse: frozenset[str] = frozenset()) -> None:
        self.threads = dict(threads or {})
        self.refuse = refuse
        self.swept: list[tuple[str, int, int]] = []

    def settle(self, cgroup: str, slack_ns: int, most: int) -> SlackSweep:
        self.swept.append((cgroup, slack_ns, most))
        n = self.threads.get(cgroup, 1)
        looked = min(n, most)
        if cgroup in self.refuse:
            return SlackSweep(refused=looked, left=n - looked)
        return SlackSweep(set=looked, left=n - looked)
