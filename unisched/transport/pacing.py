"""Registrations are paced to about one per event-loop turn, taking turns between users.

Why: a registration costs milliseconds (a cgroup made, the caller moved, the device program, a snapshot and a
decision that walk every tenant), and the daemon answers every lease renewal in the same event loop. Unpaced, a
thousand sessions opened at once would run a thousand registrations in one turn, seconds without reading a
socket, and every other tenant's leases would expire unrenewed. Paced, a renewal waits for one registration at
most: the loop reads its sockets between each.

Those waiting take turns by caller (PeerCred.caller: a uid, or a pod whatever uids its processes take): each
caller that waits gets the next turn in rotation, its own calls in the order they came. A user who keeps thousands
of registrations waiting (128 connections of 100 calls each) delays another user's registration by one turn, not by
all of theirs; a pod's process running as a host user's uid waits in its pod's place, not in that user's.

One `Pacer` per daemon, shared by the lease stream's hellos (`take`, else `queue`) and the gRPC calls that
register or list every tenant (`turn`), which cost as much. The loop's `call_soon` is passed in, so tests drive
the turns themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from unisched.policy.callers import Caller
from unisched.policy.rotation import Rotation

__all__ = ["NO_UID", "Pacer"]

NO_UID = -1
"""The turn of callers the daemon knows no uid of (the TLS listener's): they share one place in the rotation."""


class Pacer:
    """At most one registration per turn of the loop (two where an awaiting call's turn meets the next one):
    the first of a turn runs at once, later ones wait for later turns, a caller at a time in rotation."""

    def __init__(self, call_soon: Callable[[Callable[[], None]], object]) -> None:
        self._call_soon = call_soon
        self._used = False
        """This turn's registration ran (or was handed out)."""
        self._scheduled = False
        """`_next` is due at the next turn."""
        self._waiting: Rotation[Callable[[], bool]] = Rotation()
        """The calls waiting, by caller in rotation (policy.rotation)."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def take(self) -> bool:
        """This turn's registration, if nobody has it and nobody waits for one: True, and the caller registers
        now; False, and the caller queues."""
        if self._used or self._waiting:
            return False
        self._claim()
        return True

    def queue(self, run: Callable[[], bool], caller: Caller) -> None:
        """Call `run` in a later turn: after those `caller` queued before it, and after one of each other caller
        that waits ahead of it in the rotation. It returns whether it registered: one whose caller has gone (False)
        leaves the turn to the next in line."""
        self._waiting.push(caller, run)
        self._schedule()

    def withdraw(self, run: Callable[[], bool], caller: Caller) -> None:
        """`run`, queued for `caller`, is not wanted any more (its caller went away): out of the queue now, so that
        callers who queue and go away in a loop leave nothing behind."""
        self._waiting.discard(caller, run)

    async def turn(self, caller: Caller) -> None:
        """Return when it is `caller`'s turn to register (at once when the turn is free)."""
        if self.take():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def run() -> bool:
            if fut.done():  # the caller was cancelled while it waited
                return False
            fut.set_result(None)
            return True

        self.queue(run, caller)
        try:
            await fut
        except asyncio.CancelledError:
            self.withdraw(run, caller)
            raise

    def _claim(self) -> None:
        self._used = True
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._call_soon(self._next)

    def _next(self) -> None:
        self._scheduled = False
        self._used = False
        while self._waiting and not self._used:
            run = self._waiting.pop()
            self._claim()  # before run: a run that raises still leaves the next turn to the queue
            if not run():
                self._used = False
