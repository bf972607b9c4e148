"""SessionSupervisor: one thread that serves one tenant's seccomp listener. The books are accounting.py, the
listener's ioctls listener.py, video memory calls memory_calls.py.

It reads each notified call's argument from the tenant's memory (examine.read_call), decodes the class (NVOS21/NVOS64
hClass@12; XFER unwrapped), asks `decide(tenant, kind, h_class)` for new engine sessions only, keeps the counts
(RM_FREE of the object or of any ancestor, process exit and the listener's hang-up uncount them), and answers
"continue", EPERM, or EFAULT for an argument it could not read. It never wedges a tenant: any failure while handling
a call answers "continue"; a call whose notification is gone is skipped; if the daemon dies (the listener's last fd
closes), pending and later notified calls fail at once with ENOSYS and everything else keeps working. It takes each
notification in its turn of the listener's budget (budget.py), and lets go of a listener that is not the daemon's
filter's (examine.Foreign).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Final

import structlog

from unisched.enforce.nvclasses import RM_ALLOC, RM_DUP_OBJECT, RM_FREE, SessionKind
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.accounting import EventAction, SessionBook, SessionEvent, SessionUnbooked
from unisched.enforce.seccomp.allowance import Allowance, Share
from unisched.enforce.seccomp.budget import Pace
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.decisions import LoopDecisions
from unisched.enforce.seccomp.examine import Foreign, Gone, escape, log_foreign, read_call
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.enforce.seccomp.listener import Listener, Notification
from unisched.enforce.seccomp.memory_calls import REFUSAL_LOG_INTERVAL_S, MemoryCalls
from unisched.enforce.seccomp.outlet import EventOutlet
from unisched.enforce.seccomp.proc import owner_or_none, start_time
from unisched.enforce.seccomp.stats import HookCounts, SupervisorStats, Tally
from unisched.logs import Throttle

log = structlog.get_logger("unisched.seccomp")

KEEP_DECISION_S: Final = 1.0
"""At a stop that keeps the listener for a restart: how long the serving thread waits for the loop to decide the new
sessions it had asked about, before it admits the rest undecided (the loop may be busy, or gone)."""
JOIN_TIMEOUT_S: Final = 5.0
"""How long close() waits for the supervisor's thread: it never waits on the loop, so only a stuck ioctl could
keep it longer."""


class SessionSupervisor:
    """Serves ONE seccomp listener fd for ONE tenant (see the module docstring).

    Two ways to run it; either way one thread of its own receives and answers the notifications, and it owns
    the fd: `close()` (or the tenant's last process exiting) closes it.

    - `serve_forever()` in a thread of the caller's: `decide` and `on_event` run on that thread.
    - `attach(loop)` (the daemon): the supervisor starts its own thread, which answers every call that needs no
      decision at once, without the loop (the hundred-odd allocations of a CUDA context never wait for it). Only
      the first object of a new session waits: `decide` is called on the loop (call_soon_threadsafe) and the
      thread answers when it returns, while it keeps answering the tenant's other calls. `on_event` runs on the
      loop too. If the loop is closed, a session call is admitted (never wedged); a decision still on the loop
      when the supervisor closes is not asked any more (unless the listener is kept: `close`), or reported
      ABORTED when it had been admitted.

    On kernels >= 6.6 the listener is put in sync wake-up mode (`sync_wake_up`): the tenant only waits while
    its call is handled, so the kernel runs the supervisor's thread on the tenant's CPU and back, instead of
    waking another (possibly idle) CPU each way. The caller then resumes there once the thread sleeps again, so
    all the thread does for a call, before its answer or after, is the caller's wait.

    `decide` and `on_event` must be quick and non-blocking; `decide` is consulted only for the first object of
    an engine session (accounting.py says which objects join one), and an exception in it admits the call.
    `stats()` may be called from any thread; `close()` too (with `attach`, it joins the supervisor's thread).

    `allowance`: the entries all the tenant's books may hold together (hooks.TENANT_BOUNDS); `user_allowance`: all
    the books of the listeners one non-root user handed over (hooks.USER_BOUNDS). Both books draw on both, and give
    back all they held when the supervisor finishes. None: no such bound. `carried`: a listener kept over a restart,
    whose processes made objects this daemon never saw (memory.MemoryBook's carried_before). `pace`: the turns in
    which notifications are taken (budget.py; None: as fast as they come).
    """

    def __init__(
        self,
        listener_fd: int,
        tenant: str,
        decide: Callable[[str, SessionKind, int], bool],
        on_event: Callable[[SessionEvent], None] | None = None,
        *,
        reconcile_interval_s: float = 2.0,
        latency_window: int = 4096,
        join_window_s: float = 1.0,
        sync_wake_up: bool = True,
        memory: MemoryLedger | None = None,
        allowance: Allowance | None = None,
        user_allowance: Allowance | None = None,
        carried: bool = False,
        keep_decision_s: float = KEEP_DECISION_S,
        pace: Pace | None = None,
    ) -> None:
        self.tenant = tenant
        self._pace = pace
        self._keep_decision_s = keep_decision_s
        self.allowance = allowance
        self.user_allowance = user_allowance
        self._listener = Listener(listener_fd, self._warn_once)
        since = start_time(os.getpid()) if carried else None  # (memory.MemoryBook's carried_before)
        self._mem = MemoryCalls(tenant, memory, self._listener, self._warn_once,
                                share=Share(allowance, user_allowance), carried_before=int(since) if since else None)
        self._decide = decide
        self._events = EventOutlet(tenant, on_event)
        self._reconcile_interval = reconcile_interval_s
        self._lock = threading.Lock()
        self._book = SessionBook(tenant, int(join_window_s * 1e9), share=Share(allowance, user_allowance))
        self._tally = Tally(latency_window)
        """(under `_lock`)"""
        self._sync_wake_up = sync_wake_up and self._listener.set_sync_wake_up()
        self._warned: set[str] = set()
        self.refusal_log = Throttle(REFUSAL_LOG_INTERVAL_S)
        """Session refusal lines by kind (memory_calls.REFUSAL_LOG_INTERVAL_S); tests give it a clock."""
        self._closed = False
        self._gives_up = lambda: self._closed
        """(whether a turnstile's waiter gives up: made once, not per call)"""
        self._dropped = False
        """The listener was closed for a foreign call (`_forsake`) while the books still follow its processes."""
        self._keep = False
        self._kept_fd: int | None = None
        self._finished = False
        self._done = threading.Event()
        self._serving = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._decisions = LoopDecisions(tenant, decide, self._events, self._lock, self._wake_w,
                                        lambda: not (self._closed and not self._keep) and not self._dropped)

    # ---- running ----
    def serve_forever(self) -> None:
        """Serve until `close()` or until every process of the filter has exited. Blocking; for a thread."""
        with self._lock:
            if self._closed or self._serving or self._loop is not None:
                raise SeccompError("this supervisor is closed or already serving")
            self._serving = True
        self._serve()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve from a thread of its own, asking `decide` (and calling `on_event`) on `loop`."""
        with self._lock:
            if self._closed or self._serving or self._loop is not None:
                raise SeccompError("this supervisor is closed or already serving")
            self._loop = self._events.loop = loop
            self._serving = True
            self._thread = threading.Thread(target=self._serve, name=f"unisched-seccomp-{self.tenant}", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as e:  # no thread to be had: nobody would answer, so let go of the listener (ENOSYS)
            self._thread = None
            self._finish(EventAction.DETACHED)
            raise SeccompError(f"cannot start the session supervisor's thread: {e}") from None

    def close(self, join_s: float = JOIN_TIMEOUT_S, *, keep: bool = False) -> None:
        """Stop serving and close the listener. Any thread; with `attach`, returns once its thread has ended, or
        after `join_s` (0: at once; `join` waits later).

        Closing while the tenant still runs makes its pending and later session allocations fail with ENOSYS;
        sessions still counted are reported DETACHED. `keep`: answer every call received instead (one waiting for
        the loop's decision gets it, within `keep_decision_s`, or is admitted) and keep the listener open for
        `take_kept`, so that the tenant's later calls wait for whoever serves it next (a restart); a listener whose
        processes have all exited is closed.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                self._keep = keep
            serving = self._serving
            if first and serving:  # the serving thread closes the fd itself once it wakes up
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"x")
        if first and serving and self._pace is not None and self._pace.turnstile is not None:
            self._pace.turnstile.wake_all()  # or at its owner's turnstile
        if first and not serving:
            self._finish(EventAction.DETACHED)
        if join_s > 0:
            self.join(join_s)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the serving thread to end after `close` (logged when it does not)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("seccomp supervisor thread did not stop", tenant=self.tenant)

    @property
    def closed(self) -> bool:
        return self._done.is_set()

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def _serve(self) -> None:
        listening, waking = select.poll(), select.poll()
        listening.register(self._listener.fd, select.POLLIN)
        for poller in (listening, waking):
            poller.register(self._wake_r, select.POLLIN)
        next_reconcile = time.monotonic() + self._reconcile_interval
        turn: float | None = None  # the pace's turn taken for the next notification
        why = EventAction.DETACHED
        pace, wake_r, listener_fd, monotonic = self._pace, self._wake_r, self._listener.fd, time.monotonic  # (fixed)
        try:
            while not self._closed:
                ahead = 0.0 if turn is None or pace is None else turn - pace.clock()
                wait_s = next_reconcile - monotonic()
                poller = waking if self._dropped or ahead > 0 else listening
                events = dict(poller.poll(max(0, math.ceil((min(wait_s, ahead) if ahead > 0 else wait_s) * 1000))))
                try:
                    if events.get(wake_r, 0):
                        self._drain_wake()
                        self._answer_decided()
                    ev = events.get(listener_fd, 0) if poller is listening else 0
                    if ev & select.POLLIN:
                        if pace is not None and turn is None:
                            turn = pace.turn()  # one per notification, waited for on the next rounds if ahead
                            self._paced(turn - pace.clock())
                        if turn is None or pace is None or turn <= pace.clock():
                            turn = None
                            self._handle_in_turn()
                    elif ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                        why = EventAction.EXITED  # every process using the filter has exited: their sessions are gone
                        return
                    if monotonic() >= next_reconcile:
                        next_reconcile = monotonic() + self._reconcile_interval
                        self.reconcile()
                    if self._dropped and not self._follows():
                        why = EventAction.EXITED  # a forsaken listener's processes have all exited
                        return
                except Exception:  # a bug here must not take the tenant's hooks down: log it, serve on
                    with self._lock:
                        self._tally.errors += 1
                    log.exception("seccomp supervisor error; serving on", tenant=self.tenant)
        finally:
            if self._keep and why is not EventAction.EXITED:
                self._await_decisions()
            self._finish(why)

    def _await_decisions(self) -> None:
        """Before a kept listener's pending calls are answered: wait (up to `keep_decision_s`) for the loop to decide
        those it was asked about, so that a restart admits no new session past its caps undecided."""
        self._decisions.await_back(self._wake_r, self._keep_decision_s, self._drain_wake)

    def _drain_wake(self) -> None:
        """Empty the wake-up pipe (close() and the loop's decisions write to it; one read takes every byte)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def _finish(self, action: EventAction) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._closed = True
            self._serving = False
            keep = (self._keep and action is not EventAction.EXITED and not self._dropped
                    and not self._listener.hung_up())
            if keep:
                self._kept_fd = self._listener.fd
            elif not self._dropped:
                os.close(self._listener.fd)
            os.close(self._wake_r)
            os.close(self._wake_w)
            decided = self._decisions.stop_taking()
        if keep:  # every call received is answered: the next server of the listener cannot see them
            self._decisions.answer_all(self._listener, decided)
        events = self._decisions.drop(decided)
        self._mem.release_all()
        self._events.emit(events + self._book.release_all(action))
        self._done.set()
        log.debug("seccomp supervisor closed", tenant=self.tenant, why=action.value)

    def take_kept(self) -> int | None:
        """After `close(keep=True)` has finished (`closed`): the listener, the caller's to close from now on; None
        when it was closed after all (its processes had all exited) or is taken already."""
        with self._lock:
            fd, self._kept_fd = self._kept_fd, None
        return fd

    # ---- process exit ----
    def reconcile(self) -> None:
        """Uncount the sessions of RM clients whose process has exited (the driver freed them on close).

        Runs on the serving thread every `reconcile_interval_s`; do not call it from another thread while serving.
        """
        owners = self._book.owners() | self._mem.book.owners()
        gone = [h for h, (tgid, start) in owners.items() if tgid and start_time(tgid) != start]
        self._events.emit(self._book.release(gone, EventAction.EXITED))
        self._mem.release(gone)

    def _follows(self) -> bool:
        """Whether the books still hold what a live process made (reconcile releases what an exited one made)."""
        owners = self._book.owners() | self._mem.book.owners()
        return any(tgid for tgid, _ in owners.values())

    # ---- a listener not the daemon's filter's ----
    def _forsake(self, notif: Notification) -> None:
        """A call the daemon's filter never notifies (examine.Foreign): let it go on and close the listener, so that
        its processes' later notified calls fail at once with ENOSYS and cost the daemon nothing. The thread stays
        until they have exited (reconcile), the books holding what they made meanwhile: closing a listener must
        not shed the sessions and memory its processes still hold."""
        with self._lock:  # all said before the answer: the caller may look as soon as it resumes
            self._tally.notifications += 1
            self._dropped = True
            # the calls waiting for a decision are forgotten here: none is answered but by the close below
            events = self._decisions.drop(self._decisions.stop_taking())
        log_foreign(self.tenant, notif)
        self._listener.answer(notif.nid, 0)
        os.close(self._listener.fd)  # a call notified meanwhile, or waiting for its decision, fails with ENOSYS here
        self._events.emit(events)

    # ---- one notification ----
    def _handle_in_turn(self) -> None:
        """`_handle_one` once the owner's turnstile lets this thread in (budget.Turnstile), unless it closes first."""
        turnstile = None if self._pace is None else self._pace.turnstile
        if turnstile is None:
            self._handle_one()
        elif (ticket := turnstile.enter(self._gives_up)) is not None:
            try:
                self._handle_one()
            finally:
                turnstile.leave(ticket)

    def _handle_one(self) -> None:
        notif = self._listener.receive()
        if notif is None:
            return
        t0 = time.perf_counter_ns()
        nid, pid = notif.nid, notif.pid
        call: Call | None = None
        admitted = True  # every call that needs no decision goes on
        unbooked: SessionUnbooked | None = None
        failure: tuple[str, BaseException] | None = None
        try:
            call = self._examine(notif)
            if call.unreadable:
                self._refuse_unreadable(nid, t0)
                return
            if call.mem_bytes is not None and self._mem.ledger is not None:  # charged or refused by MemoryCalls
                memory = call
                self._answer_apart(t0, lambda: self._mem.conclude(nid, pid, memory))
                return
            if call.op == RM_DUP_OBJECT and (copy_refused := self._mem.copy_refusal(call)) is not None:
                copy = call
                self._answer_apart(t0, lambda: self._mem.refuse_copy(nid, pid, copy, copy_refused))
                return
            opens = call.kind is not None and self._book.needs_decision(call, pid, time.monotonic_ns())
            unbooked = self._book.unbooked(call)
            if unbooked is not None:  # refused, not admitted uncounted (accounting.SessionBounds)
                admitted = False
                self._warn_once("sessions", "a GPU session call the session book cannot record (its bounds, its "
                                "tenant's or its user's, or a process not known) was refused; later ones are logged at debug "
                                f"({unbooked.value}; {self._book.size()})")
            elif opens and call.kind is not None:
                if self._loop is not None:
                    self._ask_loop(self._loop, nid, pid, t0, call)
                    return
                try:
                    admitted = bool(self._decide(self.tenant, call.kind, call.h_class))
                except Exception as e:
                    failure = ("seccomp decide() failed; admitting the call", e)
        except Gone:
            with self._lock:
                self._tally.notifications += 1
                self._tally.skipped += 1
            return
        except Foreign:
            self._forsake(notif)
            return
        except Exception as e:
            failure, call = ("seccomp notification handling failed; letting the call continue", e), None
        self._conclude(nid, pid, t0, call, admitted, failure, unbooked)

    def _ask_loop(self, loop: asyncio.AbstractEventLoop, nid: int, tid: int, t0: int, call: Call) -> None:
        """A new session: ask `decide` on the loop; `_answer_decided` answers when it is back."""
        try:
            self._decisions.ask(loop, nid, tid, t0, call)
        except RuntimeError as e:  # the loop is closed: nobody can decide, and the caller must not wait
            self._conclude(nid, tid, t0, call, True, ("the daemon's event loop is closed; admitting the call", e))
            return
        with self._lock:
            self._tally.asked += 1

    def _answer_decided(self) -> None:
        while (back := self._decisions.take()) is not None:
            nid, (call, tid, t0), admitted, error = back
            if call.owner is None:  # its client, known when the call came, may have been freed since: read it now
                self._read_owner(call, tid)
                if call.owner is not None and not self._listener.id_valid(nid):
                    call.owner = (0, "")  # the caller is gone: not the owner of whatever took its tid
            failure = None if error is None else ("seccomp decide() failed; admitting the call", error)
            self._conclude(nid, tid, t0, call, admitted, failure, decided=True)

    def _conclude(
        self, nid: int, pid: int, t0: int, call: Call | None, admitted: bool, failure: tuple[str, BaseException] | None,
        unbooked: SessionUnbooked | None = None, decided: bool = False,
    ) -> None:
        """Count, answer, then report: the tail of every notification, decided or not. `unbooked`: why the call was
        refused without a decision (the session book could not record it); `decided`: the event loop decided it."""
        refused = False
        events: list[SessionEvent] = []
        if call is not None:
            refused = call.kind is not None and not admitted
            try:
                # Book-keeping happens before the answer, so counts are exact by the time the caller resumes;
                # callbacks and logging wait until after it, so they cost the caller nothing.
                events = self._commit(call, nid, pid, refused)
            except Exception as e:
                failure, refused = ("seccomp notification handling failed; letting the call continue", e), False
                if admitted and call.kind is not None and call.join is None:  # decide() may have reserved
                    events = [SessionEvent(self.tenant, EventAction.ABORTED, call.kind, call.h_class, pid, call.handle, 0)]
                call = None
        with self._lock:
            self._tally.notifications += 1
        answered = self._listener.answer(nid, -errno.EPERM if refused else 0)
        self._timed(t0, answered, decided)
        if not answered:
            events = self._book.undo(call, events)
            if call is not None:
                self._mem.unbook_call(call)
        self._events.emit(events)
        if failure is not None:
            with self._lock:
                self._tally.errors += 1
            log.error(failure[0], tenant=self.tenant, pid=pid, exc_info=failure[1])
        if refused and call is not None and answered:  # past the bounds a flood may be on: the warning said it once
            held = None if unbooked is not None else self.refusal_log.allow(str(call.kind))
            (log.debug if held is None else log.info)(
                "gpu session refused", tenant=self.tenant, kind=str(call.kind), h_class=f"{call.h_class:#06x}", pid=pid,
                why="the daemon's decision" if unbooked is None else unbooked.value,
                held_back=held or 0)

    def _examine(self, notif: Notification) -> Call:
        """Decode the call from the caller's memory. Call(0) means: nothing to decide or track, continue. Foreign: not
        a call the daemon's filter sends; Gone: the caller went away while it was read."""
        call = read_call(notif.pid, escape(notif), notif.args[2], self._warn_once)
        if call.op == 0:
            return call
        self._read_owner(call, notif.pid)
        # Before a decision or a count that depends on what was read, make sure it was read from the caller
        # (its pid not reused meanwhile). Frees check in _commit, only when they uncount something.
        if (call.kind is not None or call.mem_bytes is not None) and not self._listener.id_valid(notif.nid):
            raise Gone
        return call

    def _refuse_unreadable(self, nid: int, t0: int) -> None:
        """A call whose argument could not be read from its caller (examine.read_call): failed with EFAULT, as the
        driver fails an argument it cannot read. Letting it go on would let the driver read what the books never saw
        (memory the daemon's reads cannot reach: memfd_secret's). Gone when the caller went away meanwhile."""
        if not self._listener.id_valid(nid):
            raise Gone
        self._warn_once("unreadable", "a GPU call's argument could not be read from its caller; failed with EFAULT "
                        "(later ones are not logged)")
        self._answer_apart(t0, lambda: self._listener.answer(nid, -errno.EFAULT))

    def _read_owner(self, call: Call, tid: int) -> None:
        """The process of the call's RM client, when a book does not know the client yet (it is recorded under it)."""
        known = self._book.knows(call.h_root) and (self._mem.ledger is None or self._mem.book.holds(call.h_root))
        if call.op in (RM_ALLOC, RM_DUP_OBJECT) and not known:
            call.owner = owner_or_none(tid)

    def _commit(self, call: Call, nid: int, pid: int, refused: bool) -> list[SessionEvent]:
        """Book the answered call; the events to report after the answer."""
        if (call.op == RM_FREE and (self._book.holds_sessions(call.h_root) or self._mem.holds(call.h_root))
                and not self._listener.id_valid(nid)):
            return []  # read from a process that is gone: uncount nothing
        self._mem.book_call(call, refused)
        events = self._book.commit(call, pid, refused, time.monotonic_ns())
        if self._book.untracked:
            self._warn_once("nodes", "too many RM objects or clients tracked; frees of ancestors may be missed until exit")
        return events

    def _answer_apart(self, t0: int, answer: Callable[[], bool]) -> None:
        """A call answered apart from the session books (MemoryCalls', or one that could not be read): `answer` answers
        it (and says whether it was), counted like every answer, before it, so the counts are exact by the time the
        caller resumes."""
        with self._lock:
            self._tally.notifications += 1
        self._timed(t0, answer())

    def _timed(self, t0: int, answered: bool, decided: bool = False) -> None:
        """After an answer (or a call found gone): its latency, for `stats`, up to the answer's SEND call, which is
        summed apart (`Listener.send_ns`: with sync wake-up the caller may run on this CPU inside it). The
        notification was counted before the answer, so the counts are exact by the time the caller resumes."""
        send = self._listener.send_ns if answered else 0
        dt = max(0, time.perf_counter_ns() - t0 - send)
        with self._lock:
            self._tally.answered(dt, send, answered, decided)

    def _paced(self, ahead_s: float) -> None:
        """A notification's turn taken; `ahead_s` how long it waits for it (counted when it waits at all)."""
        if ahead_s > 0:
            with self._lock:
                self._tally.paced(ahead_s)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, tenant=self.tenant)

    # ---- numbers ----
    def counts(self) -> HookCounts:
        """The running totals alone: O(1), for every metrics refresh (`stats` sorts its samples and reads the books)."""
        with self._lock:
            return self._tally.counts(self.tenant)

    def stats(self) -> SupervisorStats:
        books = self._book.counts()
        with self._lock:
            return self._tally.stats(self.tenant, books, len(self._decisions.pending), self._done.is_set(), self._sync_wake_up,
                                     self._dropped)
