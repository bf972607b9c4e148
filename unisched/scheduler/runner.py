"""The asyncio side of the engine: call advance() (a tick every slice, and a rationed slice's steps between) until
asked to stop, thaw everything on the way out (also when a tick raises). What a tick reads from the machine is
read on a worker thread first. Beside it, where `timer_slack_us` is set, the tenants' threads are swept once a
second (scheduler.slack), on a worker thread of their own, so that a sweep never delays a slice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog

from unisched.logs import Throttle
from unisched.scheduler.core import Scheduler
from unisched.scheduler.readings import Readings
from unisched.scheduler.slack import SLACK_EVERY_S

__all__ = ["LATE_WARN_S", "READ_OVERDUE_S", "LateSlices", "run_engine", "run_slack"]

log = structlog.get_logger("unisched.scheduler")

LATE_WARN_S = 0.1
"""A slice that starts this much later than its loop asked is logged (at most once every LATE_LOG_EVERY_S): the
event loop was blocked or the daemon not scheduled, and every lease renewal and call waited as long."""
LATE_LOG_EVERY_S = 10.0

READ_OVERDUE_S = 2.0
"""A tick's read (NVML, the tenants' cgroup files) that has not come back after this long is overdue: a GPU fallen
off the bus or a wedged driver can hold NVML for good. Every tenant is thawed meanwhile (the daemon fails open),
and a stop does not wait for the read. A read takes milliseconds a GPU; 2 s leaves a many-GPU host's slowest
reads far inside it, and a stuck one still thaws well before the watchdog (30 s) restarts the daemon."""


class LateSlices:
    """Logs a slice that started LATE_WARN_S or more after its loop asked, at most once every LATE_LOG_EVERY_S."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._due: float | None = None
        self._throttle = Throttle(LATE_LOG_EVERY_S, now)

    def expect(self, delay_s: float) -> None:
        """The loop is about to wait `delay_s` for the next slice."""
        self._due = self._now() + delay_s

    def check(self) -> float | None:
        """After the wait: how late the slice is when that is logged now (None: on time, or held back)."""
        if self._due is None:
            return None
        late = self._now() - self._due
        if late < LATE_WARN_S or (held := self._throttle.allow("late")) is None:
            return None
        log.warning("slice loop ran late: the event loop was blocked or the daemon not scheduled",
                    late_ms=round(late * 1000, 1), earlier_late_slices_not_logged=held)
        return late


async def run_engine(engine: Scheduler, stop: asyncio.Event, alive: Callable[[], None] | None = None,
                     read_overdue_s: float = READ_OVERDUE_S) -> None:
    """Tick until `stop` is set. The loop is what keeps time in production; tests call tick() directly.

    `alive` is called after every slice that ran (the systemd watchdog): a loop that hangs or whose slices
    keep failing stops calling it, and neither does a read that never comes back (`read_overdue_s`: everything is
    thawed while it is overdue; a stop thaws and ends without it)."""
    late = LateSlices(time.monotonic)
    sweeping = asyncio.ensure_future(run_slack(engine, stop)) if engine.sweeps_slack else None
    # one waiter for the whole run: a wait_for(stop.wait()) per slice makes a task and, at each timeout, cancels it
    # and waits for that: some five loop turns a slice, which a lease renewal due meanwhile waits behind
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while not stop.is_set():
            try:
                # a tick's reads block (NVML, one cgroup file per tenant): on a worker thread, so that lease
                # renewals and seccomp decisions are served meanwhile; the tick itself runs here
                readings = await _read(engine, stopped, read_overdue_s) if engine.tick_due() else None
                if stop.is_set():
                    break
                delay = engine.advance(readings)
            except Exception:
                log.exception("slice failed; thawing everything and going on")
                engine.thaw_all()
                delay = engine.config.slice_ms / 1000.0
            else:
                if alive is not None:
                    alive()
            late.expect(delay)
            await asyncio.wait((stopped,), timeout=delay)
            late.check()
    finally:
        stopped.cancel()
        if sweeping is not None:
            sweeping.cancel()
        engine.shutdown()


async def _read(engine: Scheduler, stopped: asyncio.Future[Any], overdue_s: float) -> Readings | None:
    """A tick's reads on a worker thread; None when `stopped` came first (the thread is left to finish on its own:
    a read stuck in the driver must not keep the tenants frozen through a stop)."""
    reading = asyncio.ensure_future(asyncio.to_thread(engine.readings_reader()))
    done, _ = await asyncio.wait((reading, stopped), timeout=overdue_s, return_when=asyncio.FIRST_COMPLETED)
    if not done:
        thawed = engine.thaw_all()
        log.error("a tick's read of the GPUs is overdue (NVML or the driver not answering); every tenant is thawed "
                  "until it comes back", overdue_s=overdue_s, thawed=len(thawed))
        done, _ = await asyncio.wait((reading, stopped), return_when=asyncio.FIRST_COMPLETED)
    if reading not in done:
        reading.add_done_callback(_drop_result)
        return None
    return reading.result()


def _drop_result(reading: asyncio.Future[Readings]) -> None:
    """The read left behind at a stop: its result (or error) is not wanted."""
    if not reading.cancelled():
        reading.exception()


async def run_slack(engine: Scheduler, stop: asyncio.Event) -> None:
    """Sweep the tenants' timer slack every SLACK_EVERY_S until `stop` is set (nothing while it is off). A sweep
    that fails is logged and the next one runs."""
    while not stop.is_set():
        sweep = engine.slack_sweeper()
        if sweep is None:
            return  # off
        try:
            engine.note_slack(await asyncio.to_thread(sweep))
        except Exception:
            log.exception("timer slack sweep failed; sweeping again in a second")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SLACK_EVERY_S)
