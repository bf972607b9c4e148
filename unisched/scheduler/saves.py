"""Writing the state file off the event loop, on one writer thread.

A write is two fsyncs (the file and its directory): a millisecond or more on a local disk, tens on a slow or network
one. The tick's periodic save (what registrations leave, `context.save_soon`) holds no caller's answer, yet made on
the event loop it would hold every lease renewal, seccomp decision and call meanwhile, and any local user may
register. So the loop serialises the tenants (a consistent snapshot) and `StateWriter.hand_off` gives the bytes to
one thread: at most one write in flight and one waiting, a newer snapshot replacing the waiting one.

Saves a caller relies on (an admin's weight, a removal, an adoption, shutdown) are written before the call returns
(`write_now`), after the write in flight and instead of the waiting one: snapshots are numbered in the order the
loop took them and none is written after a newer one, so the file never goes back."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from unisched.scheduler.state import StateStore

__all__ = ["Snapshot", "StateWriter"]

log = structlog.get_logger("unisched.state")


@dataclass(frozen=True)
class Snapshot:
    """The state file's bytes, numbered in the order the loop took them."""

    number: int
    body: bytes


class StateWriter:
    """The state file's one writer thread: started when a snapshot is handed off, gone once none waits.

    A failed write there is logged and remembered (`take_failure`), so the loop saves again; the thread and the
    daemon go on."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._waiting: Snapshot | None = None
        self._writing = False
        self._thread: threading.Thread | None = None
        self._taken = 0
        self._written = 0
        """The newest snapshot written (or tried): an older one is never written after it."""
        self._failed = False
        self.closed = False

    def hand_off(self, body: bytes) -> None:
        """Have `body` written on the writer thread; returns at once. Once closed (the daemon stopped), written
        here."""
        with self._cond:
            if not self.closed:
                self._taken += 1
                self._waiting = Snapshot(self._taken, body)  # the one waiting, if any, is older: never written
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="unisched-save", daemon=True)
                    self._thread.start()
                return
        self.write_now(body)

    def write_now(self, body: bytes) -> None:
        """Write `body` on the calling thread and return once it is on disk; a failure raises to the caller. The
        snapshot waiting is dropped (this one is newer) and the write in flight finished first, however long the
        disk takes (a write here would wait as long)."""
        with self._cond:
            self._taken += 1
            number = self._taken
            self._waiting = None
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
        ok = False
        try:
            self._store.write(body)
            ok = True
        finally:
            with self._cond:
                self._writing = False
                self._written = number
                self._failed = self._failed and not ok  # written: newer than any snapshot that failed
                self._cond.notify_all()

    def take_failure(self) -> bool:
        """Whether a write on the thread failed since the last call and nothing newer was written since (the
        loop then saves again)."""
        with self._cond:
            failed, self._failed = self._failed, False
            return failed

    def wait(self, timeout_s: float) -> bool:
        """Until nothing waits or is being written; False when `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None and not self._writing, timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Write on the calling thread from now on, and let the thread end (within `timeout_s`; False: it is still
        writing). The caller writes the last state itself (`write_now`)."""
        with self._cond:
            self.closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._writing)  # a write_now in flight finishes first
                snap = self._waiting
                if snap is None or snap.number <= self._written:
                    self._waiting = self._thread = None
                    self._cond.notify_all()
                    return
                self._waiting = None
                self._writing = True
            ok = self._write(snap.body)
            with self._cond:
                self._writing = False
                self._written = snap.number
                self._failed = not ok
                self._cond.notify_all()

    def _write(self, body: bytes) -> bool:
        try:
            self._store.write(body)
        except OSError as e:  # disk full, EIO, a read-only file system: the loop's next save tries again
            log.error("state file not written; the next slice writes it again", path=str(self._store.path),
                      error=e.strerror or str(e))
            return False
        except Exception:
            log.exception("state file not written; the next slice writes it again", path=str(self._store.path))
            return False
        return True
