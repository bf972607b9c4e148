"""Moving a registering caller's process into its tenant's cgroup, on a thread of its own.

Writing a pid to cgroup.procs takes the kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU
grace period: milliseconds per move. Made on the event loop, each registration would hold every lease renewal,
every seccomp decision and the slice that long, and any local user may register. So the daemon makes the move on
`MoveThread`'s single worker (one move at a time: the kernel makes them one at a time anyway), and the loop goes
on serving; without a loop (tests, `Scheduler.register`) the same `move_caller` runs inline. The moves waiting
take turns by caller (a uid, or a pod whatever uids its processes take: policy.callers), as the registrations
before them do (transport.pacing): one user's burst of registrations delays another user's move by one move, not
by all of theirs."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from unisched.enforce.cgroups import CgroupDriver, CgroupError
from unisched.enforce.seccomp.proc import parent
from unisched.policy.callers import Caller
from unisched.policy.rotation import Rotation
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
    turn: Caller = 0
    """Whose turn the move waits for (MoveThread): the caller's (RegisterAsk.counted_as)."""


def move_caller(m: Move) -> str | None:
    """Move the caller into `m.cgroup`; returns the cgroup it came from (None: unknown). If it exited meanwhile,
    the pid may name another process by now: whatever process holds the pid in the cgroup is moved out
    (`move_stranger_out`), and the call fails."""
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
    out = move_stranger_out(m)
    if out is not None:
        log.warning("moved a reused pid out", pid=m.pid, cgroup=out)
    raise SchedulerError("failed", CALLER_GONE)


def move_back(m: Move, origin: str | None) -> bool:
    """Undo a move: the process holding the pid in `m.cgroup` goes back to `origin` (nothing when it is elsewhere
    or the origin is unknown); returns whether it did. Best effort: the registration fails either way."""
    with contextlib.suppress(OSError, CgroupError):
        if origin is not None and m.driver.cgroup_of(m.pid) == m.cgroup:
            m.driver.attach(origin, m.pid)
            return True
    return False


def move_stranger_out(m: Move) -> str | None:
    """The caller was gone when its move ran, so the process holding the pid in `m.cgroup` now is not the caller: it
    goes to its parent's cgroup (where a new process starts), not to where the caller came from (the caller's
    choice, perhaps a cgroup it may freeze). Nothing when it is elsewhere or its parent's cgroup is unknown; returns
    where it went."""
    with contextlib.suppress(OSError, CgroupError, ValueError):
        if m.driver.cgroup_of(m.pid) != m.cgroup:
            return None
        ppid = parent(m.pid)
        home = None if ppid is None else m.driver.cgroup_of(ppid)
        if home is not None and home != m.cgroup:
            m.driver.attach(home, m.pid)
            return home
    return None


@dataclass(frozen=True)
class _Job:
    work: Callable[[], Any]
    future: asyncio.Future[Any]
    """Done on the loop that asked (its own)."""


class MoveThread:
    """The moves' worker: one thread, started at the first move, whose results come back on the loop that asked.

    One at a time bounds the threads a burst of registrations can make. The moves waiting take turns by caller
    (policy.rotation). How many wait is bounded by the registrations the transport lets in (its pacer starts at
    most about one a loop turn, and the front door bounds each uid's connections and their calls). `close` (at
    shutdown) does not wait: the thread finishes the moves asked for, each within milliseconds, and the loop need
    not stay for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: Rotation[_Job] = Rotation()
        self._thread: threading.Thread | None = None
        self.closed = False

    def submit(self, work: Callable[[], T], turn: Caller = 0) -> asyncio.Future[T]:
        """Run `work` on the move thread in `turn`'s turn (a caller's); the future is done on the running loop.
        Raises SchedulerError once closed."""
        if self.closed:
            raise SchedulerError("failed", STOPPING)
        job = _Job(work, asyncio.get_running_loop().create_future())
        with self._cond:
            self._waiting.push(turn, job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="unisched-move", daemon=True)
                self._thread.start()
            self._cond.notify()
        return job.future

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()

    def _next(self) -> _Job | None:
        """The next move in rotation (None: closed, and none waits); called holding the lock."""
        self._cond.wait_for(lambda: bool(self._waiting) or self.closed)
        if not self._waiting:
            self._thread = None
            return None
        return self._waiting.pop()

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
            if job is None:
                return
            try:
                result = job.work()
            except BaseException as e:  # the loop's caller gets it, as run_in_executor would give it
                self._settle(job, None, e)
            else:
                self._settle(job, result, None)

    @staticmethod
    def _settle(job: _Job, result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (the daemon stopped): nobody waits
            job.future.get_loop().call_soon_threadsafe(settle)
