"""The session book's bounds (enforce/seccomp/accounting.py) against a tenant that makes up RM calls without end.

Every field of an RM call is the caller's to write and the driver's refusal of a made-up one is never seen, so a
flood of fake RM_ALLOCs (new hRoots, objects joining a session) must leave the root daemon's book at its bounds,
refuse the session calls it cannot record as a cap refusal is refused (EPERM, counted as refused) instead of admitting
them uncounted, keep an honest tenant's counts exact, and drop what a process recorded when it exits. Driven through
the supervisor's own handling of a notification (`_handle_one`) with a fake listener standing in for the kernel and
the call already decoded: these are tests of the book-keeping, the real path is test_seccomp.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import structlog
import structlog.testing

from unisched.enforce.nvclasses import RM_ALLOC, RM_FREE, SessionKind, classify
from unisched.enforce.seccomp.accounting import (
    MAX_SESSION_OBJECTS,
    EventAction,
    SessionBook,
    SessionBookSize,
    SessionBounds,
    SessionLedger,
    SessionUnbooked,
)
from unisched.enforce.seccomp.allowance import Allowance, Share
from unisched.enforce.seccomp.calls import Call
from unisched.enforce.seccomp.listener import Notification
from unisched.enforce.seccomp.memory import MAX_CLIENTS
from unisched.enforce.seccomp.memory_calls import REFUSAL_LOG_INTERVAL_S
from unisched.enforce.seccomp.proc import owner
from unisched.enforce.seccomp.supervisor import SessionSupervisor
from unisched.logs import Throttle

GRAPHICS, COMPUTE, CHANNEL = 0xCB97, 0xCBC0, 0xC86F
ROOT = 0xC1D00001  # the honest process's RM client
FLOOD = 0x9000_0000  # the flooder's made-up ones
TID = 4242


@dataclass
class FakeListener:
    """The kernel's side: hands out the queued notifications, keeps each answer; every caller is still there."""

    fd: int
    queue: list[Notification] = field(default_factory=list)
    answers: list[int] = field(default_factory=list)
    send_ns: int = 0
    """(Listener.send_ns: the last answer's SEND call took no time here)"""

    def receive(self) -> Notification | None:
        return self.queue.pop(0) if self.queue else None

    def answer(self, nid: int, error: int, *, run: bool = True) -> bool:
        self.answers.append(error)
        return True

    def id_valid(self, nid: int) -> bool:
        return True


class Served:
    """A supervisor of one tenant fed decoded calls (the decoding from /proc/PID/mem is left out)."""

    def __init__(self, tenant: str, ledger: SessionLedger, bounds: SessionBounds | None = None,
                 allowance: Allowance | None = None) -> None:
        r, w = os.pipe()
        os.close(w)
        self.sup = SessionSupervisor(r, tenant, ledger.decide, ledger.on_event, sync_wake_up=False, allowance=allowance)
        self.sup._book = SessionBook(tenant, 1_000_000_000, bounds or SessionBounds(), Share(allowance))
        self.listener = FakeListener(r)
        self.sup._listener = self.listener  # type: ignore[assignment]
        self._calls: list[Call] = []
        self.sup._examine = lambda *_: self._calls.pop(0)  # type: ignore[method-assign]

    @property
    def book(self) -> SessionBook:
        return self.sup._book

    def call(self, call: Call, tid: int = TID) -> int:
        """Serve one call; its answer (0: it goes on, -EPERM: refused)."""
        self._calls.append(call)
        self.listener.queue.append(Notification(len(self.listener.answers), tid, 16, 0, [0] * 6))
        self.sup._handle_one()
        return self.listener.answers[-1]

    def alloc(self, root: int, handle: int, h_class: int, who: tuple[int, str], parent: int = 0) -> int:
        return self.call(Call(RM_ALLOC, root, parent or root, handle, h_class, classify(h_class), owner=who))

    def free(self, root: int, handle: int) -> int:
        return self.call(Call(RM_FREE, root, root, handle))


@pytest.fixture
def processes() -> Iterator[tuple[tuple[int, str], tuple[int, str]]]:
    """(honest, flooder): this test's process, which lives on, and a real process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = owner(child.pid)
    assert child.stdin is not None
    child.stdin.close()
    child.wait(30)
    yield owner(os.getpid()), gone


def no_caps(tenant: str, kind: SessionKind) -> int | None:
    return None


def test_a_flood_of_made_up_clients_leaves_the_book_at_its_bound_and_refuses_their_sessions(
        processes: tuple[tuple[int, str], tuple[int, str]]) -> None:
    _, hostile = processes
    ledger = SessionLedger(no_caps)
    served = Served("t", ledger)
    answers = []
    for i in range(MAX_CLIENTS + 50):
        answers.append((served.alloc(FLOOD + i, 1, CHANNEL, hostile), served.alloc(FLOOD + i, 2, GRAPHICS, hostile)))
    assert served.book.size().clients == MAX_CLIENTS
    assert answers[:MAX_CLIENTS] == [(0, 0)] * MAX_CLIENTS
    assert answers[MAX_CLIENTS:] == [(0, -errno.EPERM)] * 50  # other calls go on unfollowed; sessions as over a cap
    assert ledger.refused("t") == {SessionKind.GRAPHICS: 50} == served.sup.stats().refused
    assert ledger.live("t") == {SessionKind.GRAPHICS: MAX_CLIENTS}  # what went on is counted, nothing more
    served.sup.close()


def test_objects_joining_a_session_stop_at_the_bound_and_are_refused_past_it() -> None:
    """Compute objects of one thread within the join window join its session without a decision, so a cap never
    refuses them: the book's bound must, or one session could grow the daemon without end."""
    book = SessionBook("t", 1_000_000_000)
    refused = 0
    for _ in range(MAX_SESSION_OBJECTS + 100):
        call = Call(RM_ALLOC, ROOT, ROOT, 0, COMPUTE, SessionKind.COMPUTE, owner=(1, "s"))  # driver-picked handles
        book.needs_decision(call, TID, 0)
        why = book.unbooked(call)
        refused += why is not None
        book.commit(call, TID, why is not None, 0)
    assert book.size() == SessionBookSize(clients=1, nodes=MAX_SESSION_OBJECTS, objects=MAX_SESSION_OBJECTS)
    assert refused == 100 and book.counts().refused == {SessionKind.COMPUTE: 100}
    assert book.counts().live == {SessionKind.COMPUTE: 1}
    assert book.unbooked(Call(RM_ALLOC, ROOT, ROOT, 7, GRAPHICS, SessionKind.GRAPHICS)) is SessionUnbooked.OBJECTS
    book.release([ROOT], EventAction.EXITED)
    assert book.size() == SessionBookSize(0, 0, 0)


def test_an_honest_tenant_s_counts_stay_exact_beside_a_flood(processes: tuple[tuple[int, str], tuple[int, str]]) -> None:
    honest_proc, hostile_proc = processes
    caps = {("honest", SessionKind.GRAPHICS): 3, ("hostile", SessionKind.GRAPHICS): 3}
    ledger = SessionLedger(lambda tenant, kind: caps.get((tenant, kind)))
    small = SessionBounds(clients=4, nodes=16, objects=8)
    honest, hostile = Served("honest", ledger, small), Served("hostile", ledger, small)
    for i in range(200):
        hostile.alloc(FLOOD + i, 1, CHANNEL, hostile_proc)
        hostile.alloc(FLOOD + i, 2, GRAPHICS, hostile_proc)
        hostile.alloc(FLOOD, 0x100 + i, COMPUTE, hostile_proc)
    assert hostile.book.size().clients == small.clients and hostile.book.size().objects <= small.objects
    assert ledger.live("hostile")[SessionKind.GRAPHICS] == 3  # its own cap held too
    assert [honest.alloc(ROOT, h, GRAPHICS, honest_proc) for h in (1, 2, 3, 4)] == [0, 0, 0, -errno.EPERM]
    assert honest.free(ROOT, 2) == 0
    assert honest.alloc(ROOT, 5, GRAPHICS, honest_proc) == 0
    assert ledger.live("honest") == {SessionKind.GRAPHICS: 3} == honest.sup.stats().live
    assert ledger.refused("honest") == {SessionKind.GRAPHICS: 1}
    honest.sup.close()
    hostile.sup.close()


def test_the_flooder_s_exit_empties_the_book_and_its_tenant_opens_sessions_again(
        processes: tuple[tuple[int, str], tuple[int, str]]) -> None:
    """reconcile() drops the clients of exited processes, so the same tenant's next process is recorded and counted
    as if nothing happened (while the book is full, its session calls are refused, not admitted uncounted)."""
    honest, hostile = processes
    ledger = SessionLedger(no_caps)
    served = Served("t", ledger, SessionBounds(clients=8, nodes=32, objects=16))
    for i in range(100):
        served.alloc(FLOOD + i, 1, CHANNEL, hostile)
        served.alloc(FLOOD + i % 8, 0x100 + i, GRAPHICS, hostile, parent=1)
    assert served.book.size() == SessionBookSize(clients=8, nodes=24, objects=16)
    assert served.alloc(ROOT, 1, GRAPHICS, honest) == -errno.EPERM
    served.sup.reconcile()
    assert served.book.size() == SessionBookSize(0, 0, 0) and ledger.live("t") == {}
    assert served.alloc(ROOT, 1, GRAPHICS, honest) == 0
    assert ledger.live("t") == {SessionKind.GRAPHICS: 1} and served.book.owners() == {ROOT: honest}
    served.sup.close()


def test_a_client_whose_process_is_not_known_is_not_recorded() -> None:
    """Reconcile could never drop it (tgid 0 is never found gone): its session calls are refused, the rest unfollowed."""
    served = Served("t", SessionLedger(no_caps))
    assert served.alloc(ROOT, 1, CHANNEL, (0, "")) == 0
    assert served.alloc(ROOT, 2, GRAPHICS, (0, "")) == -errno.EPERM
    assert served.book.size() == SessionBookSize(0, 0, 0) and served.book.untracked == 0
    served.sup.close()


def test_freed_objects_under_ever_new_parents_leave_nothing_behind() -> None:
    """Parents named once each, their only child freed, must not leave empty entries behind."""
    book = SessionBook("t", 0)
    for i in range(1000):
        book.commit(Call(RM_ALLOC, ROOT, 0x10_0000 + i, 1, CHANNEL, owner=(1, "s")), TID, False, 0)
        book.commit(Call(RM_FREE, ROOT, ROOT, 1), TID, False, 0)
    assert book.size().nodes == 0
    assert not book._clients[ROOT].children


def test_a_session_object_taken_back_leaves_no_node() -> None:
    """A caller gone before its answer (it can interrupt its own calls) must not leave its object in the tree."""
    book = SessionBook("t", 0)
    for i in range(1000):
        call = Call(RM_ALLOC, ROOT, ROOT, 0x100 + i, GRAPHICS, SessionKind.GRAPHICS, owner=(1, "s"))
        book.undo(call, book.commit(call, TID, False, 0))
    assert book.size() == SessionBookSize(1, 0, 0)


def test_refusals_over_a_cap_log_one_info_line_a_second_and_say_how_many_they_held_back(
        processes: tuple[tuple[int, str], tuple[int, str]]) -> None:
    """An app retrying past its cap in a loop must not fill the host's log with a line per call; the counts stay
    exact (the ledger, the metrics)."""
    honest_proc, _ = processes
    ledger = SessionLedger(lambda tenant, kind: 1)
    served = Served("t", ledger)
    now = [0.0]
    served.sup.refusal_log = Throttle(REFUSAL_LOG_INTERVAL_S, clock=lambda: now[0])
    assert served.alloc(ROOT, 1, GRAPHICS, honest_proc) == 0
    with structlog.testing.capture_logs() as logs:
        for handle in range(2, 102):
            assert served.alloc(ROOT, handle, GRAPHICS, honest_proc) == -errno.EPERM
        now[0] += REFUSAL_LOG_INTERVAL_S
        assert served.alloc(ROOT, 200, GRAPHICS, honest_proc) == -errno.EPERM
    lines = [(e["log_level"], e.get("held_back")) for e in logs if e["event"] == "gpu session refused"]
    assert [e for e in lines if e[0] == "info"] == [("info", 0), ("info", 99)]
    assert len(lines) == 101 and ledger.refused("t") == {SessionKind.GRAPHICS: 101}
    served.sup.close()
