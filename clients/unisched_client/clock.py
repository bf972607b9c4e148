"""Injected time: the client asks a Clock for the time and waits through it; tests advance a FakeClock.

Every timed wait in the client (an acquire's timeout, the slice's end, the renewal interval, the reconnect
back-off, the registration and ack timeouts) is a wait on the client's condition variable with a timeout, so one
primitive covers them all: `wait(cond, timeout)`, called with `cond` held, returns when `cond` is notified or
`timeout` seconds of this clock have passed (or spuriously: every caller loops on its own condition). The daemon's
engine has the same shape (unisched.scheduler.clock), which this package may not import.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SystemClock", "wait_for"]


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        """Wait on `cond` (held by the caller) until notified or `timeout` seconds (None: no limit) have passed."""
        ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    """time.monotonic itself, not a method calling it: acquire() and done() ask it on every unit."""

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        cond.wait(timeout)


def wait_for(clock: Clock, cond: threading.Condition, done: Callable[[], bool], timeout: float | None) -> bool:
    """Wait on `cond` (held) until `done()` or `timeout` seconds of `clock` have passed; returns `done()`."""
    deadline = None if timeout is None else clock.monotonic() + timeout
    while not done():
        left = None if deadline is None else deadline - clock.monotonic()
        if left is not None and left <= 0:
            return False
        clock.wait(cond, left)
    return True


@dataclass(frozen=True)
class _Sleep:
    cond: threading.Condition
    deadline: float | None
    thread: str


class FakeClock:
    """Time that moves only when a test calls `advance()`, which wakes the waits it made due.

    A test drives a client thread step by step without sleeping: `sleeps(name)` counts the waits the thread of
    that name entered, and `await_sleep(name, after=n)` blocks (in real time, with a generous limit) until that
    thread waits for the (n+1)th time, returning the timeout it asked for; then it is parked until notified or
    advanced past."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Condition()
        self._sleeping: dict[object, _Sleep] = {}
        self._entered: Counter[str] = Counter()
        self._timeouts: dict[str, float | None] = {}

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def wait(self, cond: threading.Condition, timeout: float | None) -> None:
        if timeout is not None and timeout <= 0:
            return
        token = object()
        name = threading.current_thread().name
        with self._lock:
            self._sleeping[token] = _Sleep(cond, None if timeout is None else self.now + timeout, name)
            self._entered[name] += 1
            self._timeouts[name] = timeout
            self._lock.notify_all()
        try:
            cond.wait()  # advance() notifies it holding `cond`, which it gets only once this wait released it
        finally:
            with self._lock:
                del self._sleeping[token]

    def advance(self, seconds: float) -> None:
        """Move time on and wake the waits whose timeout has passed."""
        with self._lock:
            self.now += seconds
            due = {id(s.cond): s.cond for s in self._sleeping.values() if s.deadline is not None and s.deadline <= self.now}
        for cond in due.values():
            with cond:
                cond.notify_all()

    def sleeps(self, thread: str) -> int:
        """How many waits the thread named `thread` has entered so far."""
        with self._lock:
            return self._entered[thread]

    def await_sleep(self, thread: str, after: int = 0, limit_s: float = 30.0) -> float | None:
        """Block until the thread named `thread` waits for the (after+1)th time or later and is still waiting;
        returns the timeout it asked for. Raises TimeoutError after `limit_s` real seconds."""
        def asleep() -> bool:
            return self._entered[thread] > after and any(s.thread == thread for s in self._sleeping.values())

        with self._lock:
            if not self._lock.wait_for(asleep, limit_s):
                raise TimeoutError(f"{thread} did not wait (past wait {after}) within {limit_s:g} s")
            return self._timeouts[thread]
