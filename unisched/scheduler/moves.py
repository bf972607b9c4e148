"""Moving a registering caller's process into its tenant's cgroup, on a thread of its own.

Writing a pid to cgroup.procs takes the kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU
grace period: milliseconds per move. Made on the event loop, each registration would hold every lease renewal,
every seccomp decision and the slice that long, and any local user may register. So the daemon makes the move on
`MoveThread`'s single worker (one move at a time: the kernel makes them one at a time anyway), and the loop goes
on serving; without a loop (tests, `Scheduler.register`) the same `move_caller` runs inline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import structlog

from unisched.enforce.cgroups import CgroupDriver, CgroupError
from unisched.scheduler.tenant import CALLER_GONE, SchedulerError, need_alive

__all__ = ["STOPPING", "Move", "MoveThread", "move_back", "move_caller"]

log = structlog.get_logger("unisched.scheduler")
T = TypeVar("T")

STOPPING = "the daemon is stopping"
"""Why a registration that comes after the engine shut down is refused."""


@dataclass(frozen=True)
class Move:
    """One caller to move: all a move touches is the cgroup driver, never the scheduler's state (it may run
    while the loop changes that state)."""

    driver: CgroupDriver
    cgroup: str
    pid: int
    alive: Callable[[], bool] | None
    """Whether the process that connected still runs (None: not checked)."""


def move_caller(m: Move) -> str | None:
    """Move the caller into `m.cgroup`; returns the cgroup it came from (None: unknown). If it exited meanwhile,
    the pid may name another process by now: whatever process holds the pid in the cgroup goes back where the
    caller was, and the call fails."""
    try:
        origin = m.driver.cgroup_of(m.pid)
    except OSError:
        origin = None
    need_alive(m.alive)
    try:
        m.driver.attach(m.cgroup, m.pid)
    except CgroupError as e:
        raise SchedulerError("failed", f"cannot move pid {m.pid} into {m.cgroup}: {e}") from None
    if m.alive is None or m.alive():
        return origin
    if move_back(m, origin):
        log.warning("moved a reused pid back", pid=m.pid, cgroup=origin)
    raise SchedulerError("failed", CALLER_GONE)


def move_back(m: Move, origin: str | None) -> bool:
    """Undo a move: the process holding the pid in `m.cgroup` goes back to `origin` (nothing when it is elsewhere
    or the origin is unknown); returns whether it did. Best effort: the registration fails either way."""
    with contextlib.suppress(OSError, CgroupError):
        if origin is not None and m.driver.cgroup_of(m.pid) == m.cgroup:
            m.driver.attach(origin, m.pid)
            return True
    return False


class MoveThread:
    """The moves' worker: one thread, started at the first move, whose results come back on the loop that asked.

    One at a time bounds the threads a burst of registrations can make; the ones waiting queue in order (the
    transport's pacer starts at most about one a loop turn). `close` (at shutdown) does not wait: a move in
    flight ends on its own within milliseconds, and the loop need not stay for it."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.closed = False

    def submit(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run `work` on the move thread; the future is done on the running loop. Raises SchedulerError once closed."""
        if self.closed:
            raise SchedulerError("failed", STOPPING)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unisched-move")
        return asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False)
