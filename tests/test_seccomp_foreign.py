"""A listener that is not the daemon's filter's (examine.Foreign): a user may hand over a filter of its own that
notifies any syscall (getppid in a loop), and each notification cost the daemon a Python answer under the event
loop's interpreter lock. The first call the daemon's filter never sends is let through and the listener closed, so
its processes' later notified calls fail at once with ENOSYS at no cost to the daemon; the sessions its processes
hold stay counted until they exit. End to end with a real child behind such a filter (seccomp_child.py foreign-*)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import structlog.testing
from test_seccomp import ENOSYS, ENOTTY, GRAPHICS, Proc, needs_notify, serve, start_tenant, wait_for
from test_seccomp_loop import Loop

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp import examine
from unisched.enforce.seccomp.accounting import SessionLedger
from unisched.enforce.seccomp.supervisor import SessionSupervisor
from unisched.logs import Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The warnings' throttle on a clock of the test's (examine.foreign_log)."""
    clock = Clock()
    monkeypatch.setattr(examine, "foreign_log", Throttle(examine.FOREIGN_LOG_INTERVAL_S, clock))
    return clock


def foreign(mode: str) -> Iterator[tuple[Proc, int]]:
    proc, fd = start_tenant(f"foreign-{mode}")
    try:
        yield proc, fd
    finally:
        proc.kill()


@pytest.fixture
def getppid_tenant() -> Iterator[tuple[Proc, int]]:
    yield from foreign("getppid")


@pytest.fixture
def control_tenant() -> Iterator[tuple[Proc, int]]:
    yield from foreign("control")


def capped() -> SessionLedger:
    return SessionLedger(lambda t, kind: 1 if kind is SessionKind.GRAPHICS else None)


@needs_notify
def test_a_listener_notifying_another_syscall_is_let_go_and_its_sessions_stay_counted_until_its_process_exits(
        getppid_tenant: tuple[Proc, int], log_clock: Clock) -> None:
    proc, fd = getppid_tenant
    ledger = capped()
    sup = SessionSupervisor(fd, "t", ledger.decide, ledger.on_event, reconcile_interval_s=0.05)
    rounds: list[float] = []
    reconcile = sup.reconcile

    def counted() -> None:
        reconcile()
        rounds.append(time.monotonic())

    sup.reconcile = counted  # type: ignore[method-assign]
    thread = serve(sup)
    try:
        with structlog.testing.capture_logs() as logs:
            assert proc.call(f"alloc {GRAPHICS:#x} 0x100") == ENOTTY  # the daemon's escapes: served as ever
            assert dict(sup.stats().live) == {SessionKind.GRAPHICS: 1}
            assert proc.call("getppid") == 0  # never sent by the daemon's filter: let through, the listener let go
            assert sup.stats().foreign and sup.stats().notifications == 2
            assert proc.call("getppid") == ENOSYS  # no listener any more: the kernel fails it, the daemon sees nothing
            assert proc.call(f"alloc {GRAPHICS:#x} 0x101") == ENOSYS
            assert sup.stats().notifications == 2
        warned = [e for e in logs if e["log_level"] == "warning"]
        assert len(warned) == 1 and "not the daemon's filter" in warned[0]["event"] and warned[0]["tenant"] == "t"
        assert warned[0]["syscall"] == {"x86_64": 110, "aarch64": 173}[os.uname().machine]
        # the session its process holds is not shed by the listener's going: counted until the process exits
        seen = len(rounds)
        wait_for(lambda: len(rounds) >= seen + 2, "the supervisor to look for exited processes twice more")
        assert dict(sup.stats().live) == {SessionKind.GRAPHICS: 1} and not sup.closed
        assert ledger.live("t") == {SessionKind.GRAPHICS: 1}
        proc.kill()
        wait_for(lambda: sup.closed, "the supervisor to end once the listener's process has exited")
        wait_for(lambda: ledger.live("t") == {}, "the exited process's session to be given back")
    finally:
        sup.close()
        thread.join(10)
    assert not thread.is_alive()


@needs_notify
def test_a_listener_notifying_an_escape_the_filter_never_sends_is_let_go_at_once(
        control_tenant: tuple[Proc, int], log_clock: Clock) -> None:
    """'F'/RM_CONTROL is an ioctl of NVIDIA's, but not one the daemon's filter notifies. With nothing counted the
    supervisor ends at once; the warnings of one tenant's listeners are throttled (a user may hand over many)."""
    proc, fd = control_tenant
    ledger = capped()
    sup = SessionSupervisor(fd, "t", ledger.decide, ledger.on_event)
    thread = serve(sup)
    with structlog.testing.capture_logs() as logs:
        assert proc.call("control") == ENOTTY  # let through to the device
        wait_for(lambda: sup.closed, "the supervisor to end: nothing counted to follow")
        assert proc.call("control") == ENOSYS
        thread.join(10)
        proc.kill()
        second, fd2 = start_tenant("foreign-control")  # the same tenant's next foreign listener: held back
        try:
            sup2 = SessionSupervisor(fd2, "t", ledger.decide, ledger.on_event)
            thread2 = serve(sup2)
            assert second.call("control") == ENOTTY
            wait_for(lambda: sup2.closed, "the second supervisor to end")
            thread2.join(10)
        finally:
            second.kill()
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and warned[0]["arg1"].endswith("462a")  # 'F' 0x2A
    log_clock.now += examine.FOREIGN_LOG_INTERVAL_S
    assert examine.foreign_log.allow("t") == 1  # the next line says one was held back


@needs_notify
def test_a_session_call_waiting_for_the_loop_when_the_listener_is_let_go_fails_and_is_never_decided(
        getppid_tenant: tuple[Proc, int], log_clock: Clock) -> None:
    """Attached to a loop: a new session waits for `decide` while the same process's foreign call comes. Closing
    the listener fails the waiting call with ENOSYS, so the loop must not decide it (nor count it)."""
    proc, fd = getppid_tenant
    ledger = capped()
    asked: list[SessionKind] = []

    def decide(t: str, kind: SessionKind, h_class: int) -> bool:
        asked.append(kind)
        return ledger.decide(t, kind, h_class)

    loop = Loop()
    sup = SessionSupervisor(fd, "t", decide, ledger.on_event)
    try:
        loop.run(lambda: sup.attach(loop.loop))
        loop.hold()
        proc.send(f"thread_alloc {GRAPHICS:#x} 0x100")
        wait_for(lambda: sup.stats().pending == 1, "the session call to wait for the loop")
        # getppid runs (0) and the waiting session call fails by the listener's close (ENOSYS); each thread prints
        # its own reply, in either order
        proc.send("getppid")
        assert sorted([proc.line(), proc.line()]) == sorted(["ok 0", f"ok {ENOSYS}"])
        assert sup.stats().pending == 0 and sup.stats().foreign  # forgotten before either caller resumed
        loop.release()
        loop.run(lambda: None)  # the loop has run what was queued on it
        assert asked == [] and ledger.live("t") == {}
        wait_for(lambda: sup.closed, "the supervisor to end: nothing counted")
    finally:
        sup.close()
        loop.stop()


@needs_notify
def test_the_daemon_s_own_filter_is_served_as_before(log_clock: Clock) -> None:
    """Every escape the daemon's filter notifies is one the supervisor follows: none of them lets a listener go."""
    proc, fd = start_tenant()
    ledger = capped()
    sup = SessionSupervisor(fd, "t", ledger.decide, ledger.on_event)
    thread = serve(sup)
    try:
        for command in (f"alloc {GRAPHICS:#x} 0x100", f"xalloc {GRAPHICS:#x} 0x101", "free 0x100", "xfree 0x101",
                        f"aobj {GRAPHICS:#x} 0x102", "amem 0x102 0x103 4096", "heap 3 0x102 0x104 0 4 0",
                        "dup 0x102 0x105 0x102", "xdup 0x102 0x106 0x102", f"alloc_sx {GRAPHICS:#x} 0x107",
                        "alloc 0 0 32 0"):
            proc.call_extra(command) if command.split()[0] in ("amem", "heap") else proc.call(command)
        assert not sup.stats().foreign and sup.stats().notifications == 11
        assert not proc.answered()
    finally:
        sup.close()
        thread.join(10)
        proc.kill()
