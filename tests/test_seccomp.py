"""Session admission through seccomp user notification, end to end with a stand-in device (/dev/null).

A real child process installs the real filter and hands its listener over a socketpair with the OCI agent
message; the test runs the real SessionSupervisor on it. Calls let through reach /dev/null and fail there with
ENOTTY (the "kernel's own answer"); refused ones fail with EPERM. No root needed (no_new_privs), no GPU.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import platform
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import ROOT, child_env

from unisched.enforce import nvclasses as nv
from unisched.enforce.nvclasses import SessionKind, classify, decode_ioctl, iowr
from unisched.enforce.seccomp.abi import (
    AUDIT_ARCH_AARCH64,
    AUDIT_ARCH_I386,
    AUDIT_ARCH_X86_64,
    SECCOMP_RET_ALLOW,
    SECCOMP_RET_USER_NOTIF,
    SeccompError,
    probe,
)
from unisched.enforce.seccomp.accounting import EventAction, SessionEvent, SessionLedger
from unisched.enforce.seccomp.agent import ack_agent, parse_agent_message, recv_agent_message
from unisched.enforce.seccomp.filter import build_filter
from unisched.enforce.seccomp.handover import make_agent_message
from unisched.enforce.seccomp.supervisor import SessionSupervisor

CHILD = Path(__file__).with_name("seccomp_child.py")
UNAVAILABLE = probe()
needs_notify = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"seccomp user notification unavailable: {UNAVAILABLE}")

GRAPHICS, NVDEC, COMPUTE, OTHER = 0xCB97, 0xB8B0, 0xCBC0, 0x1234
KERNEL = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
ENOTTY, EPERM, ENOSYS = errno.ENOTTY, errno.EPERM, errno.ENOSYS


# --- pure parts ------------------------------------------------------------------------------------------------------
def test_classes_and_ioctl_decoding() -> None:
    assert classify(0xCB97) is SessionKind.GRAPHICS
    assert classify(0xCBC0) is SessionKind.COMPUTE
    assert classify(0xB8B0) is SessionKind.NVDEC
    assert classify(0xC9B7) is SessionKind.NVENC
    assert classify(0xA0BC) is SessionKind.NVENC_SW_SESSION
    assert classify(0xCED0) is SessionKind.NVJPG
    assert classify(0xB8FA) is SessionKind.OFA
    for not_a_session in (0xC56F, 0xC86F, 0xC8B5, 0xA06C, 0x0041, 0x1234):
        assert classify(not_a_session) is None
    cmd = iowr(ord("F"), nv.RM_ALLOC, 32)
    assert cmd == 0xC020462B
    assert decode_ioctl(cmd) == (0x46, 0x2B, 32)
    assert decode_ioctl(cmd | 0xFFFFFFFF00000000) == (0x46, 0x2B, 32)  # musl sign-extends the request
    assert decode_ioctl(iowr(ord("F"), nv.XFER, 16)) == (0x46, 0xD3, 16)
    assert decode_ioctl(iowr(ord("F"), nv.RM_ALLOC, 48))[2] == nv.NVOS64_SIZE


def _run_bpf(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = (0,) * 6) -> int:
    """A classic-BPF interpreter for the instructions build_filter uses, on a struct seccomp_data."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    for _ in range(len(insns) + 1):
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
        elif code == 0x54:
            acc &= k
        elif code == 0x15:
            pc += jt if acc == k else jf
        elif code == 0x06:
            return int(k)
        else:
            raise AssertionError(f"unexpected BPF opcode {code:#x}")
        pc += 1
    raise AssertionError("BPF program did not return")


def test_filter_is_well_formed_and_matches_what_it_should() -> None:
    for notify_free, match_type in ((True, True), (False, True), (True, False)):
        prog = build_filter(notify_free=notify_free, match_type=match_type)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 <= 4096
        insns = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
        for i, (code, jt, jf, k) in enumerate(insns):
            assert code in (0x20, 0x54, 0x15, 0x06), f"insn {i}: opcode {code:#x}"
            if code == 0x15:
                assert i + 1 + max(jt, jf) < len(insns), f"insn {i}: jump out of range"
            if code == 0x20:
                assert k in (0, 4, 24), f"insn {i}: loads seccomp_data offset {k}"
        assert insns[-1][0] == 0x06

    prog = build_filter()
    rm_alloc, xfer, rm_free = iowr(0x46, 0x2B, 32), iowr(0x46, 0xD3, 16), iowr(0x46, 0x29, 16)
    notif, allow = SECCOMP_RET_USER_NOTIF, SECCOMP_RET_ALLOW
    for arch, ioctl_nr in ((AUDIT_ARCH_X86_64, 16), (AUDIT_ARCH_AARCH64, 29), (AUDIT_ARCH_I386, 54)):
        for cmd in (rm_alloc, xfer, rm_free, iowr(0x46, 0x2B, 48), rm_alloc | 0xFFFFFFFF00000000):
            assert _run_bpf(prog, ioctl_nr, arch, (3, cmd, 0x1000)) == notif, (hex(arch), hex(cmd))
        for cmd in (iowr(0x46, 0x2A, 32), iowr(0x47, 0x2B, 32), 0x541B, 0x5401):  # RM_CONTROL, other type, FIONREAD
            assert _run_bpf(prog, ioctl_nr, arch, (3, cmd, 0x1000)) == allow, (hex(arch), hex(cmd))
        assert _run_bpf(prog, ioctl_nr + 1, arch, (3, rm_alloc)) == allow  # not ioctl
    assert _run_bpf(prog, 29, AUDIT_ARCH_X86_64, (3, rm_alloc)) == allow  # x86_64 nr 29 is shmget, not ioctl
    assert _run_bpf(prog, 16, 0x40000028, (3, rm_alloc)) == allow  # unknown arch (arm)
    assert _run_bpf(build_filter(notify_free=False), 16, AUDIT_ARCH_X86_64, (3, rm_free)) == allow
    assert _run_bpf(build_filter(match_type=False), 16, AUDIT_ARCH_X86_64, (3, iowr(0x47, 0x2B, 32))) == notif


RUNC_HELLO = {
    "ociVersion": "1.2.0",
    "fds": ["seccompFd"],
    "pid": 4242,
    "metadata": "tenant=render",
    "state": {
        "ociVersion": "1.2.0",
        "id": "c0ffee",
        "status": "creating",
        "pid": 4242,
        "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/c0ffee",
        "annotations": {"io.kubernetes.pod.name": "game-0"},
    },
}
CRUN_HELLO = (
    '{"ociVersion":"0.2.0","fds":["seccompFd"],"pid":777,"metadata":"","state":{"ociVersion":"0.2.0","id":"abc",'
    '"status":"running","pid":777,"bundle":"/var/lib/containers/abc/userdata"}}'
)


def test_agent_messages_from_runc_crun_and_unisched_run() -> None:
    hello = parse_agent_message(json.dumps(RUNC_HELLO).encode())
    assert (hello.pid, hello.metadata, hello.container_id, hello.status) == (4242, "tenant=render", "c0ffee", "creating")
    assert hello.annotations == {"io.kubernetes.pod.name": "game-0"}
    assert hello.fd_index == 0 and hello.oci_version == "1.2.0"
    crun = parse_agent_message(CRUN_HELLO)  # crun writes ociVersion 0.2.0 and may omit annotations
    assert (crun.pid, crun.container_id, crun.status, crun.annotations, crun.oci_version) == (777, "abc", "running", {}, "0.2.0")
    ours = parse_agent_message(make_agent_message(99, metadata="m"))
    assert (ours.pid, ours.metadata, ours.status) == (99, "m", "running")
    for bad in (b"not json", b"[1]", b'{"fds":["seccompFd"]}', b'{"pid":-1}', b'{"pid":5,"fds":["other"]}', b'{"pid":true}'):
        with pytest.raises(SeccompError):
            parse_agent_message(bad)


def test_oci_profile_notifies_exactly_the_filter_s_calls() -> None:
    """The OCI profile is the runtime's default (refusing what it does not list) plus notify rules for exactly the
    calls `unisched run`'s own filter notifies on."""
    profile = json.loads((ROOT / "deploy/seccomp/unisched-gpu.json").read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["listenerPath"] == "/run/unisched/seccomp-agent.sock"
    assert profile["listenerMetadata"] == ""
    notified = set()
    for rule in profile["syscalls"]:
        if rule["action"] != "SCMP_ACT_NOTIFY":
            continue
        assert rule["names"] == ["ioctl"]
        (arg,) = rule["args"]
        assert arg["index"] == 1 and arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["value"] == 0xFFFF
        notified.add(arg["valueTwo"])
    assert notified == {0x462B, 0x464A, 0x46D3, 0x4629}


def test_ledger_reserves_and_releases() -> None:
    ledger = SessionLedger(lambda tenant, kind: 1 if kind is SessionKind.NVDEC else None)

    def ev(action: EventAction) -> SessionEvent:
        return SessionEvent("t", action, SessionKind.NVDEC, NVDEC, 1, 5, 0)

    assert ledger.decide("t", SessionKind.NVDEC, NVDEC)
    assert not ledger.decide("t", SessionKind.NVDEC, NVDEC)  # the reservation counts
    ledger.on_event(ev(EventAction.ABORTED))
    assert ledger.decide("t", SessionKind.NVDEC, NVDEC)
    ledger.on_event(ev(EventAction.ADMITTED))
    assert ledger.live("t") == {SessionKind.NVDEC: 1}
    assert not ledger.decide("t", SessionKind.NVDEC, NVDEC)
    assert ledger.decide("u", SessionKind.NVDEC, NVDEC)  # another tenant has its own count
    ledger.on_event(ev(EventAction.FREED))
    assert ledger.live("t") == {}
    assert ledger.decide("t", SessionKind.GRAPHICS, GRAPHICS)  # uncapped kind


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

    def line(self, timeout: float = 10.0) -> str:
        assert self.popen.stdout is not None
        ready, _, _ = select.select([self.popen.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"helper process gave no answer within {timeout}s")
        out = self.popen.stdout.readline()
        if not out:
            raise AssertionError(f"helper process exited ({self.popen.poll()})")
        return out.strip()

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


def start_tenant() -> tuple[Proc, int]:
    """A tenant child with the filter installed, and the listener fd it handed over (checked like the daemon does)."""
    ours, theirs = socket.socketpair()
    proc = Proc("tenant", theirs)
    with ours:
        fd, hello = recv_agent_message(ours)
    assert hello.pid == proc.pid and hello.metadata == "test"
    assert proc.line() == "ready"
    return proc, fd


@pytest.fixture
def tenant() -> Iterator[tuple[Proc, int]]:
    proc, fd = start_tenant()
    try:
        yield proc, fd
    finally:
        proc.kill()


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
        s = sup.stats()
        assert dict(s.live) == {SessionKind.GRAPHICS: 1, SessionKind.NVDEC: 1, SessionKind.COMPUTE: 1}
        assert dict(s.refused) == {SessionKind.GRAPHICS: 3}
        assert s.notifications == 7 and s.errors == 0

        assert proc.call("fionread") == 0  # an unrelated ioctl is never notified
        assert sup.stats().notifications == 7

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
        assert ledger.refused("render") == {SessionKind.GRAPHICS: 4}

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


DAEMON_STANDIN = """
import asyncio, socket, sys, threading
from unisched.enforce.seccomp.agent import recv_agent_message
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
