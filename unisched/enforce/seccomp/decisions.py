"""The new sessions' calls a supervisor attached to the daemon's event loop asks it to decide: asked from the serving
thread, decided on the loop (`decide`), handed back through the supervisor's wake-up pipe and answered by the serving
thread. Only the first object of a new session waits for the loop; every other call is answered without it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import math
import os
import select
import threading
import time
from collections.abc import Callable

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.listener import Listener
from unisched.enforce.seccomp.outlet import EventOutlet

__all__ = ["Decided", "LoopDecisions"]

Decided = tuple[int, bool, BaseException | None]
"""A decision back from the loop: the notification id, whether `decide` admitted it, what it raised (admitted)."""


class LoopDecisions:
    """ONE supervisor's calls waiting for the loop. `lock` is the supervisor's; `wake_w` its wake-up pipe's writing
    end; `wanted()` whether a decision is still wanted (not once the listener is closed: its callers got ENOSYS)."""

    def __init__(self, tenant: str, decide: Callable[[str, SessionKind, int], bool], events: EventOutlet,
                 lock: threading.Lock, wake_w: int, wanted: Callable[[], bool]) -> None:
        self.tenant = tenant
        self._decide = decide
        self._events = events
        self._lock = lock
        self._wake_w = wake_w
        self._wanted = wanted
        self.pending: dict[int, tuple[Call, int, int]] = {}
        """Calls asked about: notification id -> (call, tid, t0). The serving thread's only."""
        self._decided: collections.deque[Decided] = collections.deque()
        """Decisions back from the loop not yet answered (under the lock: the loop appends, the serving thread takes)."""
        self._taking = True
        """Whether decisions are still taken back (under the lock); past it an admission is given back at once."""

    def ask(self, loop: asyncio.AbstractEventLoop, nid: int, tid: int, t0: int, call: Call) -> None:
        """Ask `decide` about `call` on `loop`; RuntimeError (nothing asked) when the loop is closed."""
        assert call.kind is not None
        self.pending[nid] = (call, tid, t0)
        try:
            loop.call_soon_threadsafe(self._on_loop, nid, call.kind, call.h_class)
        except RuntimeError:
            del self.pending[nid]
            raise

    def _on_loop(self, nid: int, kind: SessionKind, h_class: int) -> None:
        """On the loop: ask `decide`, hand the answer back to the serving thread."""
        if not self._wanted():
            return  # the call failed with ENOSYS when the listener closed (or will): nothing to decide
        admitted, error = False, None
        try:
            admitted = bool(self._decide(self.tenant, kind, h_class))
        except Exception as e:
            admitted, error = True, e
        with self._lock:
            if self._taking:
                self._decided.append((nid, admitted, error))
                with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the thread
                    os.write(self._wake_w, b"d")
                return
        if admitted:  # closed meanwhile: the caller got ENOSYS; give back what decide() reserved
            self._events.emit_now([SessionEvent(self.tenant, EventAction.ABORTED, kind, h_class, 0, 0, 0)])

    def take(self) -> tuple[int, tuple[Call, int, int], bool, BaseException | None] | None:
        """The next decision back with the call it decides: (nid, (call, tid, t0), admitted, error); None when none."""
        while True:
            with self._lock:
                if not self._decided:
                    return None
                nid, admitted, error = self._decided.popleft()
            entry = self.pending.pop(nid, None)
            if entry is not None:
                return nid, entry, admitted, error

    def all_back(self) -> bool:
        """Whether every call asked about has its decision back."""
        with self._lock:
            back = {nid for nid, _, _ in self._decided}
        return self.pending.keys() <= back

    def await_back(self, wake_r: int, within_s: float, drain: Callable[[], None]) -> None:
        """Wait up to `within_s` for every call asked about to have its decision back; `wake_r` (emptied by `drain`)
        is written to as each one comes."""
        deadline = time.monotonic() + within_s
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if self.all_back() or left <= 0:
                return
            poller.poll(math.ceil(left * 1000))
            drain()

    def stop_taking(self) -> list[Decided]:
        """Call under the lock: take no more decisions back (the listener is closed or kept); those back already."""
        self._taking = False
        decided = list(self._decided)
        self._decided.clear()
        return decided

    def answer_all(self, listener: Listener, decided: list[Decided]) -> None:
        """Before the listener is kept for a restart: the calls the loop decided, as it decided; those it did not,
        admitted (the books end with this supervisor anyway)."""
        verdicts = {nid: admitted for nid, admitted, _ in decided}
        for nid, (call, _, _) in self.pending.items():
            refused = call.kind is not None and not verdicts.get(nid, True)
            listener.answer(nid, -errno.EPERM if refused else 0)

    def drop(self, decided: list[Decided]) -> list[SessionEvent]:
        """Once the listener is closed or kept: forget the calls asked about. Their callers got ENOSYS when the fd
        closed (or were answered); the admissions back (`decided`) are given back: the events to report."""
        events = []
        for nid, admitted, _ in decided:
            call, tid, _t0 = self.pending.pop(nid, (None, 0, 0))
            if admitted and call is not None and call.kind is not None:
                events.append(SessionEvent(self.tenant, EventAction.ABORTED, call.kind, call.h_class, tid, call.handle, 0))
        self.pending.clear()
        return events
