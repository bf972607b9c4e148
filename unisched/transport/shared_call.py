"""One blocking call shared by every request that asks for it at about the same time.

A status request that runs a program (nvidia-cuda-mps-control) on a worker thread must not be multiplied by the
callers: a user with hundreds of calls in flight would otherwise fill the default executor, which the engine's
tick also uses for its readings, and delay the slices. Callers within `fresh_s` of the last answer get it again;
while a call runs, every caller awaits that one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["SharedCall"]

T = TypeVar("T")


class SharedCall(Generic[T]):
    """`fn` run on a worker thread at most once at a time, its answer reused for `fresh_s` (event loop only)."""

    def __init__(self, fn: Callable[[], T], fresh_s: float, clock: Callable[[], float]) -> None:
        self._fn = fn
        self._fresh_s = fresh_s
        self._clock = clock
        self._task: asyncio.Future[T] | None = None
        self._started = 0.0

    async def get(self) -> T:
        task = self._task
        if task is None or (task.done() and self._clock() - self._started >= self._fresh_s):
            self._started = self._clock()
            task = self._task = asyncio.ensure_future(asyncio.to_thread(self._fn))
        return await asyncio.shield(task)  # a caller cancelled does not cancel the others' call
