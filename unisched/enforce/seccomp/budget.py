"""How the daemon takes notifications from a listener: one of its owner's (the uid that handed it over; a tenant
for root's) at a time, and no faster than a budget per listener and one per owner.

Each listener is a Python thread that shares the interpreter lock with the event loop, and a caller's notified
call costs it the same whether the call is real or a flood (a hooked process calling RM_FREE on fd -1 in a loop).
One thread answering as fast as it can leaves the loop the lock at each of its system calls; a hundred answering
at once leave it waiting behind all of them. So the listeners of one owner take turns (`Turnstile`, first come
first served): however many an owner hands over, one of its threads handles a notification at a time. And the
budget makes a listener's thread wait before it takes the next notification off the kernel's queue, so that one
owner's calls together take a bounded share of the interpreter: OWNER_RATE a second beyond a burst. Nothing is
answered without being read: the calls past the budget wait in the kernel, their caller with them, and the books
stay exact (answering "continue" undecoded would let an allocation through uncounted).

The budget is the generic cell rate algorithm: each call reserves the next slot of its listener's rate and then of
its owner's. Pure but for the locks; the clock is passed in.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Final

__all__ = ["LISTENER_BURST", "LISTENER_RATE", "OWNER_BURST", "OWNER_RATE", "TURN_HELD_MAX_S", "Pace", "Rate", "Turnstile"]

LISTENER_RATE: Final = 1000.0
"""Notifications a second one listener is answered beyond its burst. A CUDA or EGL context's start makes 130-odd
notified calls, spaced by the driver's own work (~2.6 ms each on the H200: bench/hook_answer.py, so ~400 a second),
and a framework allocates through its caching allocator afterwards; an app that allocates and frees video memory in
a tight loop without one is slowed to this, its counts exact (docs/security.md)."""
LISTENER_BURST: Final = 1024
"""Calls one listener may make at once before its rate holds: several contexts' start-ups in one process group."""
OWNER_RATE: Final = 2000.0
"""Notifications a second all the listeners of one owner (a non-root uid, or one of root's tenants: a container
runtime's pod) are answered beyond its burst, however many listeners it hands over. A call read from its caller's
memory costs a thread ~50 us of CPU alone and up to ~180 us when a hundred of one owner's listeners take turns
(RM_FREE on fd -1; 2-core VM): a tenth to a third of a core."""
OWNER_BURST: Final = 2048
"""Calls all of one owner's listeners may make at once: 15 contexts starting together."""


TURN_HELD_MAX_S: Final = 0.1
"""A turn held longer than this is taken from its thread by the first waiter: the thread is blocked, not handling
(a caller's memory behind a FUSE mount that never answers, read by examine.read_call), and must not stop its
owner's other listeners. A notification's handling takes well under a millisecond otherwise."""


class _Waiter:
    __slots__ = ("handed", "lock", "ticket")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()  # released when the turn is handed over, or by wake_all
        self.handed = False
        self.ticket = 0


class Turnstile:
    """One owner's listeners handle one notification at a time, in the order they came: the turn is handed to the
    first waiter (none can slip in ahead of it), so no listener of the owner waits behind another's flood for long.
    A turn held past `held_max_s` (by the injectable `clock`) is taken by the first waiter; the blocked thread's
    `leave` then does nothing (each turn has a ticket)."""

    def __init__(self, held_max_s: float = TURN_HELD_MAX_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._busy = False
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._held_max_s = held_max_s
        self._clock = clock
        self._ticket = 0
        """The turn now held (its holder's `enter` returned it)."""
        self._since = 0.0
        """When the turn now held was taken."""

    @property
    def waiting(self) -> int:
        """Threads waiting for their turn now."""
        with self._lock:
            return len(self._queue)

    def enter(self, give_up: Callable[[], bool]) -> int | None:
        """Wait for the turn: its ticket, for `leave`; None (not entered) once `give_up()` says so, asked before
        each wait (`wake_all`)."""
        while True:
            with self._lock:
                if not self._busy:
                    return self._take()
                if give_up():
                    return None
                waiter = _Waiter()
                self._queue.append(waiter)
            while not waiter.lock.acquire(timeout=self._held_max_s):
                with self._lock:
                    if waiter.handed:  # (handed just as the wait ended)
                        break
                    if waiter not in self._queue:  # wake_all took it just as the wait ended
                        break
                    if self._queue[0] is waiter and self._clock() - self._since >= self._held_max_s:
                        self._queue.popleft()
                        return self._take()  # the holder is blocked: this thread's turn now
            if waiter.handed:
                return waiter.ticket

    def _take(self) -> int:
        """The turn is the caller's (under the lock)."""
        self._busy = True
        self._ticket += 1
        self._since = self._clock()
        return self._ticket

    def leave(self, ticket: int) -> None:
        """End the turn `ticket` (nothing where it was taken from its holder meanwhile): the first waiter's now."""
        with self._lock:
            if ticket != self._ticket:
                return
            if self._queue:
                waiter = self._queue.popleft()
                waiter.ticket = self._take()
                waiter.handed = True
                waiter.lock.release()
            else:
                self._busy = False

    def wake_all(self) -> None:
        """Every waiter asks its `give_up` again (a supervisor closing), and waits again at the back if it goes on."""
        with self._lock:
            waiters, self._queue = self._queue, collections.deque()
        for waiter in waiters:
            waiter.lock.release()


class Rate:
    """One rate's turns: `per_s` a second beyond a burst of `burst`. Not thread-safe: Pace locks it."""

    def __init__(self, per_s: float, burst: int) -> None:
        if per_s <= 0 or burst < 1:
            raise ValueError(f"a rate needs per_s > 0 and burst >= 1, got {per_s}, {burst}")
        self._interval = 1.0 / per_s
        self._tolerance = (burst - 1) * self._interval + 1e-9  # (a nanosecond for the sums' rounding)
        self._due: float | None = None
        """When the next call is due at the rate (the algorithm's theoretical arrival time)."""

    def full(self, at: float) -> bool:
        """Whether its whole burst is there again at `at`: forgetting it then gives nothing away."""
        return self._due is None or self._due <= at

    def reserve(self, at: float) -> float:
        """The next turn at or after `at`, taken: when the call may be answered."""
        due = at if self._due is None else self._due
        turn = max(at, due - self._tolerance)
        self._due = max(turn, due) + self._interval
        return turn


class Pace:
    """One listener's turns: its own rate's and its owner's (shared by the owner's listeners, with one lock), and its
    owner's turnstile (None: its thread handles its notifications whenever they are due)."""

    def __init__(self, own: Rate, owner: Rate | None = None, lock: threading.Lock | None = None,
                 clock: Callable[[], float] = time.monotonic, turnstile: Turnstile | None = None) -> None:
        self._own = own
        self._owner = owner
        self._lock = lock if lock is not None else threading.Lock()
        self.clock = clock
        self.turnstile = turnstile

    def turn(self) -> float:
        """Take the next turn: the clock's time from which the listener may receive its next notification."""
        with self._lock:
            at = self._own.reserve(self.clock())
            return at if self._owner is None else self._owner.reserve(at)
