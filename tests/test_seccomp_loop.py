"""The session supervisor attached to the daemon's event loop, end to end with a stand-in device (/dev/null):
calls that need no decision are answered without the loop, a closing or closed loop neither wedges a call nor
reserves for it, a daemon killed mid-call fails the call cleanly, and the hand-over to the agent socket."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import child_env
from test_seccomp import (
    ENOSYS,
    ENOTTY,
    EPERM,
    GRAPHICS,
    KERNEL,
    NVDEC,
    OTHER,
    ROOT,
    Proc,
    needs_notify,
    running_tenant,
    serve,
    wait_for,
)

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent, SessionLedger
from unisched.enforce.seccomp.agent import ack_agent, recv_agent_message
from unisched.enforce.seccomp.proc import start_time
from unisched.enforce.seccomp.supervisor import SessionSupervisor


@pytest.fixture
def tenant() -> Iterator[tuple[Proc, int]]:
    yield from running_tenant()


class Loop:
    """An asyncio loop on a thread (the daemon's), with a gate that holds it busy: what runs on the loop
    cannot run while the gate is shut, so anything answered meanwhile was answered without it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-event-loop", daemon=True)
        self.thread.start()
        self._open = threading.Event()
        self._held = threading.Event()

    def run(self, fn: Callable[[], object]) -> None:
        async def call() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(call(), self.loop).result(10)

    def hold(self) -> None:
        """Block the loop (it runs nothing else) until `release()`."""
        self._open.clear()
        self._held.clear()

        def blocked() -> None:
            self._held.set()
            self._open.wait(30)

        self.loop.call_soon_threadsafe(blocked)
        assert self._held.wait(10), "the loop did not start the blocking callback"

    def release(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self.release()
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    try:
        yield lp
    finally:
        lp.stop()


@needs_notify
def test_attached_supervisor_answers_non_session_calls_without_the_loop(tenant: tuple[Proc, int], loop: Loop) -> None:
    """With attach(loop), memory/channel/copy allocations and frees are answered by the supervisor's thread while
    the loop is blocked and the engine hook (decide) is never called for them; a new session waits for decide,
    which runs on the loop, and is still counted or refused by its cap."""
    proc, fd = tenant
    ledger = SessionLedger(lambda t, kind: 1 if kind is SessionKind.GRAPHICS else None)
    asked: list[tuple[SessionKind, str]] = []
    event_threads: set[str] = set()

    def decide(t: str, kind: SessionKind, h_class: int) -> bool:
        asked.append((kind, threading.current_thread().name))
        return ledger.decide(t, kind, h_class)

    def on_event(e: SessionEvent) -> None:
        event_threads.add(threading.current_thread().name)
        ledger.on_event(e)

    sup = SessionSupervisor(fd, "t", decide, on_event)
    if KERNEL >= (6, 6):  # SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP: supervisor and caller wake on each other's CPU
        assert sup.stats().sync_wake_up
    before = set(threading.enumerate())
    loop.run(lambda: sup.attach(loop.loop))
    (serving,) = set(threading.enumerate()) - before
    try:
        loop.hold()
        for h in range(40):
            assert proc.call(f"alloc {(0xC86F, 0xC8B5, 0xA06C, 0x0040)[h % 4]:#x} {0x400 + h:#x}") == ENOTTY
        assert proc.call(f"xalloc {OTHER:#x} 0x500") == ENOTTY
        assert proc.call("free 0x400") == ENOTTY
        assert proc.call("alloc 0 0 32 0") == ENOTTY  # unreadable argument: continue, nothing to decide
        assert asked == [] and sup.stats().notifications == 43 and sup.stats().asked_loop == 0

        proc.send(f"alloc {GRAPHICS:#x} 0x100")  # a new session: waits for decide() on the (blocked) loop
        wait_for(lambda: sup.stats().pending == 1, "the session call to wait for the loop")
        assert asked == []
        loop.release()
        assert proc.line() == f"ok {ENOTTY}"
        assert asked == [(SessionKind.GRAPHICS, "test-event-loop")]

        loop.hold()  # the tenant's other calls do not queue behind a pending decision
        proc.send(f"alloc {GRAPHICS:#x} 0x101")
        wait_for(lambda: sup.stats().pending == 1, "the second session call to wait for the loop")
        loop.release()
        assert proc.line() == f"ok {EPERM}"  # beyond the cap of 1: refused
        assert proc.call(f"alloc {NVDEC:#x} 0x102") == ENOTTY
        s = sup.stats()
        assert dict(s.live) == {SessionKind.GRAPHICS: 1, SessionKind.NVDEC: 1} and dict(s.refused) == {SessionKind.GRAPHICS: 1}
        assert (s.asked_loop, s.pending, s.errors) == (3, 0, 0)
        assert proc.call("free 0x100") == ENOTTY  # a free needs no decision; its event reaches the loop
        wait_for(lambda: ledger.live("t") == {SessionKind.NVDEC: 1}, "the ledger to see the free")
        assert event_threads == {"test-event-loop"}  # on_event runs on the loop, like decide
    finally:
        loop.run(sup.close)
    assert sup.closed and sup.stats().pending == 0
    assert not serving.is_alive()  # close() joined the supervisor's thread
    assert proc.call(f"alloc {OTHER:#x} 0x300") == ENOSYS


@needs_notify
def test_closing_with_a_decision_pending_fails_the_call_and_reserves_nothing(tenant: tuple[Proc, int], loop: Loop) -> None:
    proc, fd = tenant
    asked: list[SessionKind] = []
    events: list[SessionEvent] = []
    sup = SessionSupervisor(fd, "t", lambda _t, kind, _c: asked.append(kind) is None, events.append)
    loop.run(lambda: sup.attach(loop.loop))
    loop.hold()
    proc.send(f"alloc {GRAPHICS:#x} 0x1")
    wait_for(lambda: sup.stats().pending == 1, "the session call to wait for the loop")
    sup.close()  # the daemon shuts down (from any thread): joins the supervisor's thread
    assert sup.closed
    assert proc.line() == f"ok {ENOSYS}"  # the waiting caller fails at once, not wedged
    loop.release()
    loop.run(lambda: None)  # the decision queued on the loop has run by now: it was not asked
    assert asked == [] and events == []
    assert proc.call(f"alloc {GRAPHICS:#x} 0x2") == ENOSYS
    assert proc.call("fionread") == 0


@needs_notify
def test_a_decision_made_as_the_supervisor_closes_is_given_back(tenant: tuple[Proc, int], loop: Loop) -> None:
    proc, fd = tenant
    ledger = SessionLedger(lambda t, kind: 1)
    events: list[SessionEvent] = []

    def on_event(e: SessionEvent) -> None:
        events.append(e)
        ledger.on_event(e)

    def decide(t: str, kind: SessionKind, h_class: int) -> bool:
        admitted = ledger.decide(t, kind, h_class)  # reserves the only slot...
        sup.close()  # ...as the daemon shuts down, before the supervisor's thread could answer
        return admitted

    sup = SessionSupervisor(fd, "t", decide, on_event)
    loop.run(lambda: sup.attach(loop.loop))
    assert proc.call(f"alloc {GRAPHICS:#x} 0x1") == ENOSYS
    loop.run(lambda: None)
    assert [e.action for e in events] == [EventAction.ABORTED]
    assert ledger.decide("t", SessionKind.GRAPHICS, GRAPHICS)  # the reservation was given back


@needs_notify
def test_a_closed_loop_admits_session_calls_instead_of_wedging(tenant: tuple[Proc, int], loop: Loop) -> None:
    proc, fd = tenant
    sup = SessionSupervisor(fd, "t", lambda *_: False)
    loop.run(lambda: sup.attach(loop.loop))
    try:
        loop.stop()  # the daemon's loop is gone, the supervisor's thread is not
        assert proc.call(f"alloc {GRAPHICS:#x} 0x1") == ENOTTY  # nobody can decide: admitted, never wedged
        assert proc.call(f"alloc {OTHER:#x} 0x2") == ENOTTY
        s = sup.stats()
        assert (dict(s.live), s.errors) == ({SessionKind.GRAPHICS: 1}, 1)
    finally:
        sup.close()
    assert sup.closed


@needs_notify
def test_a_client_freed_while_its_session_call_waits_for_the_loop_is_recorded_under_its_process(
        tenant: tuple[Proc, int], loop: Loop) -> None:
    """The session call's client was known when the call came (its process read then, not again), and its whole
    client was freed while the loop decided: the session is recorded under the caller's process, which the
    reconcile pass drops at its exit. It was recorded under a client of process 0, which reconcile skips: counted
    until every process of the listener had exited."""
    proc, fd = tenant
    asked, go = threading.Event(), threading.Event()
    ledger = SessionLedger(lambda t, kind: None)

    def decide(t: str, kind: SessionKind, h_class: int) -> bool:
        asked.set()
        assert go.wait(10), "the test never let the decision go"
        return ledger.decide(t, kind, h_class)

    sup = SessionSupervisor(fd, "t", decide, ledger.on_event)
    loop.run(lambda: sup.attach(loop.loop))
    try:
        assert proc.call(f"alloc {OTHER:#x} 0x400") == ENOTTY  # the client is known from here on
        proc.send(f"thread_alloc {GRAPHICS:#x} 0x500")  # waits for decide(), on the loop
        assert asked.wait(10), "the session call never reached the loop"
        assert proc.call(f"free {ROOT:#x}") == ENOTTY  # the whole client, freed without the loop meanwhile
        go.set()
        assert proc.line() == f"ok {ENOTTY}"
        assert sup._book.owners() == {ROOT: (proc.pid, start_time(proc.pid))}
        assert sup.stats().live == {SessionKind.GRAPHICS: 1}
    finally:
        go.set()
        loop.run(sup.close)


DAEMON_STANDIN = """
import asyncio, socket, sys, threading
from unisched.enforce.seccomp.agent import recv_agent_message
from unisched.enforce.seccomp.proc import start_time
from unisched.enforce.seccomp.supervisor import SessionSupervisor
with socket.socket(fileno=int(sys.argv[1])) as sock:
    fd, _ = recv_agent_message(sock)
never = threading.Event()
def decide(tenant, kind, h_class):
    print("deciding", flush=True)
    never.wait()  # a decision that never comes: the daemon dies first
    return True
loop = asyncio.new_event_loop()
sup = SessionSupervisor(fd, "t", decide)
sup.attach(loop)
print("ready", flush=True)
loop.run_forever()
"""


def _line(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"the stand-in daemon said nothing within {timeout}s")
    return proc.stdout.readline().strip()


@needs_notify
def test_daemon_killed_while_a_session_waits_for_the_loop() -> None:
    """A daemon running the real (threaded) supervisor dies while a session call waits for its loop: that call
    and later notified ones fail with ENOSYS, everything else goes on."""
    daemon_sock, tenant_sock = socket.socketpair()
    daemon = subprocess.Popen([sys.executable, "-c", DAEMON_STANDIN, str(daemon_sock.fileno())], stdout=subprocess.PIPE,
                              text=True, pass_fds=[daemon_sock.fileno()], env=child_env())
    daemon_sock.close()
    tenant = Proc("tenant", tenant_sock)
    try:
        assert tenant.line() == "ready"
        assert _line(daemon) == "ready"
        assert tenant.call(f"alloc {OTHER:#x} 0x2") == ENOTTY
        tenant.send(f"alloc {GRAPHICS:#x} 0x1")
        assert _line(daemon) == "deciding"  # the loop is now stuck in decide()
        os.kill(daemon.pid, signal.SIGKILL)
        assert tenant.line() == f"ok {ENOSYS}"  # the session call that waited fails at once
        assert tenant.call(f"alloc {OTHER:#x} 0x3") == ENOSYS
        assert tenant.call("fionread") == 0
        tenant.send("exit")
        assert tenant.popen.wait(10) == 0
    finally:
        tenant.kill()
        if daemon.poll() is None:
            daemon.kill()
        daemon.wait(10)
        if daemon.stdout is not None:
            daemon.stdout.close()


@needs_notify
def test_failures_in_the_supervisor_let_calls_continue(tenant: tuple[Proc, int]) -> None:
    proc, fd = tenant

    def broken(*_: object) -> bool:
        raise RuntimeError("policy bug")

    def broken_event(_: SessionEvent) -> None:
        raise RuntimeError("listener bug")

    sup = SessionSupervisor(fd, "t", broken, broken_event)
    thread = serve(sup)
    try:
        assert proc.call(f"alloc {GRAPHICS:#x} 0x1") == ENOTTY  # decide() raised: admitted, never wedged
        assert proc.call(f"alloc {GRAPHICS:#x} 0x2 24") == ENOTTY  # a size the driver refuses: not examined
        assert proc.call("alloc 0 0 32 0") == ENOTTY
        assert sup.stats().notifications == 3
    finally:
        sup.close()
        thread.join(10)


@needs_notify
def test_daemon_killed_mid_call_fails_the_call_cleanly() -> None:
    daemon_sock, tenant_sock = socket.socketpair()
    daemon = Proc("hold", daemon_sock)  # a stand-in daemon that receives one notification and never answers
    tenant = Proc("tenant", tenant_sock)
    try:
        assert daemon.line() == "ready" and tenant.line() == "ready"
        tenant.send(f"alloc {GRAPHICS:#x} 0x1")
        assert daemon.line() == "got"  # the tenant is now blocked in its notified ioctl
        assert tenant.popen.stdout is not None
        ready, _, _ = select.select([tenant.popen.stdout], [], [], 0.2)
        assert not ready, "the call should wait for the supervisor's answer"
        os.kill(daemon.pid, signal.SIGKILL)
        assert tenant.line() == f"ok {ENOSYS}"  # pending call fails at once
        assert tenant.call(f"alloc {NVDEC:#x} 0x2") == ENOSYS  # later notified calls too, without blocking
        assert tenant.call("fionread") == 0  # everything else goes on
        tenant.send("exit")
        assert tenant.popen.wait(10) == 0
    finally:
        tenant.kill()
        daemon.kill()


@needs_notify
@pytest.mark.parametrize("accept", [True, False])
def test_hand_over_to_the_agent_socket(tmp_path: Path, accept: bool) -> None:
    """The `unisched run` path: the child connects to the agent socket; the daemon side learns who it is from
    SO_PEERCRED (then cgroup -> tenant), receives the listener, and acknowledges or refuses it."""
    path = tmp_path / "agent.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        proc = Proc("tenant", path)
        try:
            server.settimeout(10)
            conn, _ = server.accept()
            with conn:
                peer_pid, _uid, _gid = struct.unpack("=iII", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                fd, hello = recv_agent_message(conn)
                assert peer_pid == hello.pid == proc.pid and hello.metadata == "test"
                if not accept:
                    os.close(fd)
                    ack_agent(conn, "tenant t is over its memory cap")
                    assert proc.line().startswith("refused the unisched daemon refused the GPU session hook: error tenant t")
                    assert proc.popen.wait(10) == 3
                    return
                sup = SessionSupervisor(fd, "t", lambda *_: False)
                thread = serve(sup)
                ack_agent(conn)
            assert proc.line() == "ready"
            assert proc.call(f"alloc {NVDEC:#x} 0x1") == EPERM
            proc.send("exit")
            assert proc.popen.wait(10) == 0
            thread.join(10)
            assert sup.closed and sup.stats().refused == {SessionKind.NVDEC: 1}
        finally:
            proc.kill()
