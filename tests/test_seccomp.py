"""Session admission through seccomp user notification, end to end with a stand-in device (/dev/null).

A real child process installs the real filter and hands its listener over a socketpair with the OCI agent
message; the test runs the real SessionSupervisor on it. Calls let through reach /dev/null and fail there with
ENOTTY (the "kernel's own answer"); refused ones fail with EPERM. No root needed (no_new_privs), no GPU.
"""

from __future__ import annotations

import asyncio
import errno
import os
import platform
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import child_env, wait_until

from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp.abi import (
    probe,
)
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent, SessionLedger
from unisched.enforce.seccomp.agent import recv_agent_message
from unisched.enforce.seccomp.calls import ENGINE_INSTANCES
from unisched.enforce.seccomp.supervisor import SessionSupervisor

CHILD = Path(__file__).with_name("seccomp_child.py")
UNAVAILABLE = probe()
needs_notify = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"seccomp user notification unavailable: {UNAVAILABLE}")

GRAPHICS, NVDEC, COMPUTE, OTHER = 0xCB97, 0xB8B0, 0xCBC0, 0x1234
ROOT = 0xC1D00001  # the helper's RM client (seccomp_child.ROOT_HANDLE)
KERNEL = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
ENOTTY, EPERM, ENOSYS = errno.ENOTTY, errno.EPERM, errno.ENOSYS


# --- with the kernel -------------------------------------------------------------------------------------------------
class Proc:
    """A helper process from seccomp_child.py, driven line by line with deadlines (never a bare sleep)."""

    def __init__(self, mode: str, where: socket.socket | Path) -> None:
        fds = [where.fileno()] if isinstance(where, socket.socket) else []
        self.popen = subprocess.Popen(
            [sys.executable, str(CHILD), mode, str(fds[0] if fds else where)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=fds, env=child_env(),
        )  # fmt: skip
        if isinstance(where, socket.socket):
            where.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    _unread = ""
    """What was read from the helper's stdout past the lines taken (`line`)."""

    def line(self, timeout: float = 10.0) -> str:
        """The next line; read from the pipe itself, so that two lines that came together (a thread's reply and
        the main thread's) are both seen (a TextIOWrapper's readline would keep the second where select cannot)."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while "\n" not in self._unread:
            ready, _, _ = select.select([self.popen.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"helper process gave no answer within {timeout}s")
            chunk = os.read(self.popen.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"helper process exited ({self.popen.poll()})")
            self._unread += chunk.decode()
        out, _, self._unread = self._unread.partition("\n")
        return out.strip()

    def answered(self) -> bool:
        """Whether a line has come (without waiting)."""
        assert self.popen.stdout is not None
        return "\n" in self._unread or bool(select.select([self.popen.stdout], [], [], 0)[0])

    def send(self, command: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()

    def call(self, command: str, timeout: float = 10.0) -> int:
        self.send(command)
        return int(self.line(timeout).split()[1])

    def call_extra(self, command: str, timeout: float = 30.0) -> tuple[int, int]:
        self.send(command)
        _, err, extra = self.line(timeout).split()
        return int(err), int(extra)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()


def start_tenant(mode: str = "tenant") -> tuple[Proc, int]:
    """A tenant child with the filter installed, and the listener fd it handed over (checked like the daemon does).
    `mode`: seccomp_child.py's (foreign-*: a filter that is not the daemon's)."""
    ours, theirs = socket.socketpair()
    proc = Proc(mode, theirs)
    with ours:
        fd, hello = recv_agent_message(ours)
    assert hello.pid == proc.pid and hello.metadata == "test"
    assert proc.line() == "ready"
    return proc, fd


def running_tenant() -> Iterator[tuple[Proc, int]]:
    """A tenant process behind the real filter and its listener, killed when done (the `tenant` fixtures')."""
    proc, fd = start_tenant()
    try:
        yield proc, fd
    finally:
        proc.kill()


@pytest.fixture
def tenant() -> Iterator[tuple[Proc, int]]:
    yield from running_tenant()


def serve(sup: SessionSupervisor) -> threading.Thread:
    thread = threading.Thread(target=sup.serve_forever, name="seccomp-supervisor", daemon=True)
    thread.start()
    return thread


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@needs_notify
def test_caps_counts_and_frees_end_to_end(tenant: tuple[Proc, int]) -> None:
    proc, fd = tenant
    events: list[SessionEvent] = []
    ledger = SessionLedger(lambda t, kind: 1 if kind is SessionKind.GRAPHICS else None)

    def on_event(e: SessionEvent) -> None:
        events.append(e)
        ledger.on_event(e)

    sup = SessionSupervisor(fd, "render", ledger.decide, on_event)
    thread = serve(sup)
    try:
        assert proc.call(f"alloc {GRAPHICS:#x} 0x100") == ENOTTY  # admitted: reached the device, counted
        assert proc.call(f"alloc {GRAPHICS:#x} 0x101") == EPERM  # beyond the cap of 1
        assert proc.call(f"alloc {NVDEC:#x} 0x102") == ENOTTY
        assert proc.call(f"alloc {COMPUTE:#x} 0x103 48") == ENOTTY  # NVOS64 size
        assert proc.call(f"alloc {OTHER:#x} 0x104") == ENOTTY  # not a session: never asked, never counted
        assert proc.call(f"xalloc {GRAPHICS:#x} 0x105") == EPERM  # XFER-wrapped RM_ALLOC is unwrapped
        assert proc.call(f"alloc_sx {GRAPHICS:#x} 0x106") == EPERM  # sign-extended request still matched
        assert proc.call(f"aobj {GRAPHICS:#x} 0x10a") == EPERM  # RM_ALLOC's older form, without parameters
        s = sup.stats()
        assert dict(s.live) == {SessionKind.GRAPHICS: 1, SessionKind.NVDEC: 1, SessionKind.COMPUTE: 1}
        assert dict(s.refused) == {SessionKind.GRAPHICS: 4}
        assert s.notifications == 8 and s.errors == 0

        assert proc.call("fionread") == 0  # an unrelated ioctl is never notified
        assert sup.stats().notifications == 8

        assert proc.call("free 0x100") == ENOTTY  # RM_FREE of the graphics handle uncounts it
        assert SessionKind.GRAPHICS not in sup.stats().live
        assert proc.call(f"alloc {GRAPHICS:#x} 0x107") == ENOTTY  # so a new context gets through
        assert proc.call(f"alloc {GRAPHICS:#x} 0x108") == EPERM
        assert proc.call("xfree 0x107") == ENOTTY  # XFER-wrapped RM_FREE
        assert proc.call(f"alloc {GRAPHICS:#x} 0x109") == ENOTTY
        assert proc.call(f"alloc {OTHER:#x} 0x200") == ENOTTY  # an unknown parent object...
        assert proc.call(f"alloc {NVDEC:#x} 0x201 32") == ENOTTY
        assert proc.call("free 0xC1D00001") == ENOTTY  # ...freeing the whole client frees every session in it
        assert dict(sup.stats().live) == {}  # exact as soon as the caller resumes; events follow the answer
        wait_for(lambda: ledger.live("render") == {}, "the ledger to see the frees")
        assert ledger.refused("render") == {SessionKind.GRAPHICS: 5}

        actions = [(e.action, e.kind, e.handle) for e in events]
        assert actions[:3] == [
            (EventAction.ADMITTED, SessionKind.GRAPHICS, 0x100),
            (EventAction.REFUSED, SessionKind.GRAPHICS, 0x101),
            (EventAction.ADMITTED, SessionKind.NVDEC, 0x102),
        ]
        assert (EventAction.FREED, SessionKind.GRAPHICS, 0x100) in actions
        assert all(e.pid == proc.pid for e in events if e.action is EventAction.ADMITTED)

        s = sup.stats()
        assert s.latency_samples == s.notifications and s.latency_p50_us is not None and s.latency_p99_us is not None
        assert 0 < s.latency_p50_us <= s.latency_p99_us < 1_000_000
        notified_ns = proc.call_extra(f"bench 2000 {OTHER:#x}")[1]
        plain_ns = proc.call_extra("bench_plain 2000")[1]
        s = sup.stats()
        print(
            f"\nsupervisor answer latency over {s.latency_samples} calls: p50 {s.latency_p50_us:.1f} us, "
            f"p99 {s.latency_p99_us:.1f} us; per call in the tenant: notified RM_ALLOC {notified_ns / 1000:.1f} us, "
            f"un-notified ioctl {plain_ns / 1000:.2f} us"
        )
    finally:
        sup.close()
        thread.join(10)
    assert sup.closed and not thread.is_alive()
    assert proc.call(f"alloc {OTHER:#x} 0x300") == ENOSYS  # after the listener is gone: a clean failure, no hang
    assert proc.call("fionread") == 0


@needs_notify
def test_one_session_spans_several_objects(tenant: tuple[Proc, int]) -> None:
    """One decoder = one NVDEC object per engine (7 on the H200): a decode cap of 1 lets the whole first
    decoder through and refuses the second at its first object; a CUDA context's compute objects count once."""
    proc, fd = tenant
    asked: list[SessionKind] = []
    ledger = SessionLedger(lambda t, kind: 1 if kind is SessionKind.NVDEC else None)

    def decide(t: str, kind: SessionKind, h_class: int) -> bool:
        asked.append(kind)
        return ledger.decide(t, kind, h_class)

    sup = SessionSupervisor(fd, "video", decide, ledger.on_event)
    thread = serve(sup)
    try:
        for engine in range(7):
            assert proc.call(f"alloc_eng {NVDEC:#x} {0x10 + engine:#x} {engine}") == ENOTTY
        assert asked == [SessionKind.NVDEC]  # asked once, for the session's first object
        s = sup.stats()
        assert (dict(s.live), dict(s.objects)) == ({SessionKind.NVDEC: 1}, {SessionKind.NVDEC: 7})
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x20 0") == EPERM  # engine 0 again: a second decoder, over the cap
        for h in range(3):
            assert proc.call(f"alloc {COMPUTE:#x} {0x30 + h:#x}") == ENOTTY
        assert sup.stats().live == {SessionKind.NVDEC: 1, SessionKind.COMPUTE: 1}
        for engine in range(6):
            assert proc.call(f"free {0x10 + engine:#x}") == ENOTTY
        assert sup.stats().live[SessionKind.NVDEC] == 1  # the session holds while one of its objects lives
        assert proc.call("free 0x16") == ENOTTY
        assert SessionKind.NVDEC not in sup.stats().live
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x40 0") == ENOTTY  # a new decoder gets through
    finally:
        sup.close()
        thread.join(10)


@needs_notify
def test_a_decoder_object_churned_on_ever_new_engine_instances_leaves_its_session_the_live_objects(
        tenant: tuple[Proc, int]) -> None:
    """engineInstance is the tenant's to write: one decoder object kept while another is allocated on instances
    1..200 and freed each time. Those on an instance a GPU can have join the session and leave it with their free;
    those past any GPU's engines open (decided, capped) sessions of their own. The session keeps the instance of
    its one live object, not the 200 it once saw, which grew the daemon's memory without end."""
    proc, fd = tenant
    sup = SessionSupervisor(fd, "t", lambda *_: True, join_window_s=60)
    thread = serve(sup)
    try:
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x1 0") == ENOTTY
        assert proc.call_extra(f"churn_eng {NVDEC:#x} 0x2 200") == (0, 0)
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x3 {ENGINE_INSTANCES}") == ENOTTY  # joins nothing: its own session
        s = sup.stats()
        assert s.live == {SessionKind.NVDEC: 2}
        assert s.admitted[SessionKind.NVDEC] == 2 + 200 - (ENGINE_INSTANCES - 1)
        client = sup._book._clients[ROOT]
        assert {h: x.instances for h, x in client.sessions.items()} == {0x1: {0x1: 0}, 0x3: {}}
    finally:
        sup.close()
        thread.join(10)


@needs_notify
def test_no_joining_outside_the_window(tenant: tuple[Proc, int]) -> None:
    proc, fd = tenant
    sup = SessionSupervisor(fd, "t", lambda *_: True, join_window_s=0)
    thread = serve(sup)
    try:
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x1 0") == ENOTTY
        assert proc.call(f"alloc_eng {NVDEC:#x} 0x2 1") == ENOTTY
        assert sup.stats().live == {SessionKind.NVDEC: 2}
    finally:
        sup.close()
        thread.join(10)


@needs_notify
def test_process_exit_and_tenant_exit_uncount_sessions(tenant: tuple[Proc, int]) -> None:
    proc, fd = tenant
    events: list[SessionEvent] = []
    sup = SessionSupervisor(fd, "t", lambda *_: True, events.append, reconcile_interval_s=0.05)
    thread = serve(sup)
    try:
        # a forked process opens a session on its own client and exits: the reconcile pass uncounts it
        err, grandchild = proc.call_extra(f"fork_alloc {NVDEC:#x} 0x10 0xC1D00002")
        assert err == ENOTTY
        wait_for(lambda: any(e.action is EventAction.ADMITTED and e.pid == grandchild for e in events), "admission event")
        wait_for(lambda: SessionKind.NVDEC not in sup.stats().live, "the exited process's session to be uncounted")
        assert [e.action for e in events if e.kind is SessionKind.NVDEC] == [EventAction.ADMITTED, EventAction.EXITED]
        # the tenant's own session goes when the last process of the filter exits (the listener hangs up)
        assert proc.call(f"alloc {GRAPHICS:#x} 0x20") == ENOTTY
        assert sup.stats().live == {SessionKind.GRAPHICS: 1}
        proc.send("exit")
        assert proc.popen.wait(10) == 0
        thread.join(10)
        assert not thread.is_alive() and sup.closed
        assert events[-1].action is EventAction.EXITED and events[-1].kind is SessionKind.GRAPHICS
        assert dict(sup.stats().live) == {}
    finally:
        sup.close()


@needs_notify
def test_asyncio_attach(tenant: tuple[Proc, int]) -> None:
    proc, fd = tenant
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    sup = SessionSupervisor(fd, "t", lambda _t, kind, _c: kind is not SessionKind.NVDEC, sync_wake_up=False)
    assert not sup.stats().sync_wake_up
    try:
        asyncio.run_coroutine_threadsafe(_attach(sup, loop), loop).result(10)
        assert proc.call(f"alloc {NVDEC:#x} 0x1") == EPERM
        assert proc.call(f"alloc {GRAPHICS:#x} 0x2") == ENOTTY
        assert proc.call("fionread") == 0
        s = sup.stats()
        assert (s.notifications, dict(s.live), dict(s.refused)) == (2, {SessionKind.GRAPHICS: 1}, {SessionKind.NVDEC: 1})
        proc.send("exit")
        assert proc.popen.wait(10) == 0
        assert sup.wait_closed(10)  # hang-up seen through the loop's reader
        assert dict(sup.stats().live) == {}
    finally:
        loop.call_soon_threadsafe(sup.close)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


async def _attach(sup: SessionSupervisor, loop: asyncio.AbstractEventLoop) -> None:
    sup.attach(loop)


@needs_notify
def test_an_answers_own_system_call_is_timed_apart_from_the_daemons_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """In sync wake-up mode the answered caller may run on the supervisor's CPU inside the SEND call, so that
    call's time is summed apart (`send_s`), not in the daemon's answer time (`answer_s`). A SEND made 20 ms long
    here must show in the one and not in the other."""
    import fcntl as real_fcntl

    from unisched.enforce.seccomp import listener as listener_module
    from unisched.enforce.seccomp.abi import NOTIF_SEND

    class SlowSend:
        def __getattr__(self, name: str) -> object:
            return getattr(real_fcntl, name)

        @staticmethod
        def ioctl(fd: int, request: int, *args: object) -> object:
            got = real_fcntl.ioctl(fd, request, *args)  # type: ignore[call-overload]
            if request == NOTIF_SEND:
                end = time.perf_counter() + 0.02
                while time.perf_counter() < end:  # a SEND that takes 20 ms of this thread
                    pass
            return got

    monkeypatch.setattr(listener_module, "fcntl", SlowSend())
    proc, fd = start_tenant()
    sup = SessionSupervisor(fd, "t", lambda _t, _kind, _c: True)
    thread = serve(sup)
    try:
        for i in range(3):
            assert proc.call(f"alloc {OTHER:#x} {0x10 + i:#x}") == ENOTTY
        wait_for(lambda: sup.counts().send_s >= 3 * 0.02, "the three SEND calls summed apart")  # after each returns
        c = sup.counts()
        assert c.calls == 3 and 0 < c.answer_s < 3 * 0.02
    finally:
        sup.close()
        proc.kill()
        thread.join(10)


@needs_notify
def test_the_hooks_counts_of_a_tenant_add_up_its_listeners_and_keep_the_ended() -> None:
    """What the metrics export (unisched_tenant_hook_*): a tenant's calls over all its hooked process groups,
    never falling when one of them ends."""
    from unisched.enforce.seccomp.hooks import SupervisedHooks

    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    hooks = SupervisedHooks(lambda _t, _kind, _c: True, lambda _e: None)
    tenants = [start_tenant() for _ in range(3)]

    def on_loop(fn: Callable[[], object]) -> object:
        async def call() -> object:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), loop).result(10)

    def read() -> dict[str, tuple[int, int, bool]]:
        return {c.tenant: (c.calls, c.errors, c.answer_s > 0) for c in on_loop(hooks.counts)}  # type: ignore[attr-defined]

    def counts() -> dict[str, tuple[int, int, bool]]:
        """The calls are counted before each answer, exact once the caller resumes; a call's answer time is added
        after its SEND, which (sync wake-up) can run the caller first: wait for that alone."""
        now = read()
        wait_until(lambda: all(t for _, _, t in read().values()), 10, "the answers' times")
        return {name: (calls, errors, True) for name, (calls, errors, _) in now.items()}

    try:
        for (_, fd), name in zip(tenants, ("a", "a", "b"), strict=True):
            on_loop(lambda fd=fd, name=name: hooks.attach(fd, name, 0))
        (first, _), (second, _), (other, _) = tenants
        for proc, n in ((first, 3), (second, 2), (other, 1)):
            for i in range(n):
                assert proc.call(f"alloc {OTHER:#x} {0x10 + i:#x}") == ENOTTY
        assert other.call("fionread") == 0  # not notified: not counted
        assert counts() == {"a": (5, 0, True), "b": (1, 0, True)}
        first.send("exit")
        assert first.popen.wait(10) == 0
        ended = next(s for s, _ in hooks._supervisors if s.stats().notifications == 3)
        assert ended.wait_closed(10)
        assert counts() == {"a": (5, 0, True), "b": (1, 0, True)}  # the ended listener's calls are kept
        assert second.call(f"alloc {OTHER:#x} 0x20") == ENOTTY
        assert counts() == {"a": (6, 0, True), "b": (1, 0, True)}
    finally:
        on_loop(hooks.close)
        for proc, _ in tenants:
            proc.kill()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()
