"""The asyncio side of the engine: call tick() every slice until asked to stop, thaw everything on the
way out (also when a tick raises)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from unisched.scheduler.core import Scheduler

__all__ = ["run_engine"]

log = structlog.get_logger("unisched.scheduler")


async def run_engine(engine: Scheduler, stop: asyncio.Event, alive: Callable[[], None] | None = None) -> None:
    """Tick until `stop` is set. The loop is what keeps time in production; tests call tick() directly.

    `alive` is called after every slice that ran (the systemd watchdog): a loop that hangs or whose slices
    keep failing stops calling it."""
    try:
        while not stop.is_set():
            try:
                delay = engine.tick()
            except Exception:
                log.exception("slice failed; thawing everything and going on")
                engine.thaw_all()
                delay = engine.config.slice_ms / 1000.0
            else:
                if alive is not None:
                    alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
    finally:
        engine.shutdown()
