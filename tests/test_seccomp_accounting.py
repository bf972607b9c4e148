"""Session accounting as pure code: which RM_ALLOC / RM_FREE calls open, join and close which sessions, and how
calls are decoded from the caller's memory. Tables of calls in, events and live counts out; no kernel needed.
The agent's logic with the fake session hooks is at the end (a real socket and a real filter's listener)."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import child_env, pipe_listeners
from structlog.testing import capture_logs

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.nvclasses import NVOS00_SIZE, RM_ALLOC, RM_CONTROL, RM_FREE, XFER, SessionKind, classify, iowr
from unisched.enforce.seccomp.abi import AUDIT_ARCH_AARCH64, AUDIT_ARCH_X86_64, probe
from unisched.enforce.seccomp.accounting import EventAction, SessionBook, SessionBounds
from unisched.enforce.seccomp.agent import AgentHello
from unisched.enforce.seccomp.calls import ENGINE_INSTANCES, Call, decode_call, escape_of
from unisched.enforce.seccomp.hooks import FakeSessionHooks
from unisched.policy.callers import Pod
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import ConfigError, DaemonConfig, DeclaredTenant
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import NoGpuTelemetry
from unisched.transport.agent import HandOverLimits, SeccompAgentServer
from unisched.transport.identity import PeerCred

ROOT = 0xC1D00001
GRAPHICS, COMPUTE, NVDEC, CHANNEL = 0xCB97, 0xCBC0, 0xB8B0, 0xC86F
MS = 1_000_000
Step = tuple[str, dict[str, int]]


def alloc(handle: int, h_class: int, **kw: int) -> Step:
    return "alloc", {"handle": handle, "h_class": h_class, **kw}


def refuse(handle: int, h_class: int, **kw: int) -> Step:
    return "refuse", {"handle": handle, "h_class": h_class, **kw}


def free(handle: int) -> Step:
    return "free", {"handle": handle}


def play(steps: list[Step]) -> tuple[list[str], dict[str, int], int]:
    """Run calls through a book as the supervisor does (decide says yes unless the step is a refusal): the events
    ("action kind"), the live counts and how many decisions were asked."""
    book = SessionBook("t", join_window_ns=1000 * MS)
    events: list[str] = []
    asked = 0
    for op, a in steps:
        now = a.get("t_ms", 0) * MS
        if op == "free":
            call = Call(RM_FREE, ROOT, ROOT, a["handle"])
        else:
            owner = None if book.knows(ROOT) else (4242, "start")
            call = Call(RM_ALLOC, ROOT, a.get("parent", ROOT), a["handle"], a["h_class"], classify(a["h_class"]),
                        owner=owner, instance=a.get("instance"))
        decided = book.needs_decision(call, a.get("tid", 1), now)
        asked += decided
        for e in book.commit(call, a.get("tid", 1), op == "refuse" and decided, now):
            events.append(f"{e.action} {e.kind}")
    return events, {str(k): n for k, n in book.counts().live.items()}, asked


CASES = {
    "graphics objects are one session each": (
        [alloc(1, GRAPHICS), alloc(2, GRAPHICS), free(1)],
        ["admitted graphics", "admitted graphics", "freed graphics"], {"graphics": 1}, 2),
    "non-session objects are never counted": (
        [alloc(1, CHANNEL), alloc(2, 0x1234), free(1)], [], {}, 0),
    "compute objects of one thread within the window join": (
        [alloc(1, COMPUTE), alloc(2, COMPUTE, t_ms=500), free(1)], ["admitted compute"], {"compute": 1}, 1),
    "the session ends with its last object": (
        [alloc(1, COMPUTE), alloc(2, COMPUTE), free(1), free(2)], ["admitted compute", "freed compute"], {}, 1),
    "another thread opens its own compute session": (
        [alloc(1, COMPUTE, tid=1), alloc(2, COMPUTE, tid=2)], ["admitted compute"] * 2, {"compute": 2}, 2),
    "past the join window a new session opens": (
        [alloc(1, COMPUTE), alloc(2, COMPUTE, t_ms=1001)], ["admitted compute"] * 2, {"compute": 2}, 2),
    "a decoder's objects on new engine instances join": (
        [alloc(1, NVDEC, instance=0), alloc(2, NVDEC, instance=1)], ["admitted nvdec"], {"nvdec": 1}, 1),
    "a second decoder needs engine 0 again: a new session": (
        [alloc(1, NVDEC, instance=0), alloc(2, NVDEC, instance=1), alloc(3, NVDEC, instance=0)],
        ["admitted nvdec"] * 2, {"nvdec": 2}, 2),
    "a freed object's engine instance is free again for the session's next object": (
        [alloc(1, NVDEC, instance=0), alloc(2, NVDEC, instance=1), free(2), alloc(3, NVDEC, instance=1)],
        ["admitted nvdec"], {"nvdec": 1}, 1),
    "a video object without an instance opens its own session": (
        [alloc(1, NVDEC, instance=0), alloc(2, NVDEC)], ["admitted nvdec"] * 2, {"nvdec": 2}, 2),
    "freeing an ancestor ends the sessions below it": (
        [alloc(10, CHANNEL), alloc(1, GRAPHICS, parent=10), alloc(2, COMPUTE, parent=10), free(10)],
        ["admitted graphics", "admitted compute", "freed graphics", "freed compute"], {}, 2),
    "freeing the client ends everything it holds": (
        [alloc(1, GRAPHICS), alloc(2, NVDEC, instance=0), free(ROOT)],
        ["admitted graphics", "admitted nvdec", "freed graphics", "freed nvdec"], {}, 2),
    "the same handle again is counted once": (
        [alloc(1, GRAPHICS), alloc(1, GRAPHICS)], ["admitted graphics"], {"graphics": 1}, 1),
    "a refused call is not counted and opens nothing to join": (
        [refuse(1, COMPUTE), alloc(2, COMPUTE)], ["refused compute", "admitted compute"], {"compute": 1}, 2),
    "a handle named again under another parent moves there": (
        [alloc(10, CHANNEL), alloc(11, CHANNEL), alloc(1, GRAPHICS, parent=10), alloc(1, GRAPHICS, parent=11),
         free(10)], ["admitted graphics"], {"graphics": 1}, 1),
    "a free of an unknown handle uncounts nothing": (
        [alloc(1, GRAPHICS), free(99)], ["admitted graphics"], {"graphics": 1}, 1),
}


@pytest.mark.parametrize("steps, events, live, asked", CASES.values(), ids=list(CASES))
def test_calls_open_join_and_close_sessions(steps: list[Step], events: list[str], live: dict[str, int], asked: int) -> None:
    got, got_live, got_asked = play(steps)
    assert sorted(got) == sorted(events)  # one free ends sessions in no particular order
    assert (got_live, got_asked) == (live, asked)


def test_a_call_gone_before_its_answer_is_taken_back() -> None:
    book = SessionBook("t", join_window_ns=1000 * MS)
    call = Call(RM_ALLOC, ROOT, ROOT, 1, GRAPHICS, SessionKind.GRAPHICS, owner=(1, "s"))
    undone = book.undo(call, book.commit(call, 7, False, 0))
    assert [(e.action, e.live) for e in undone] == [(EventAction.ABORTED, 0)]
    counts = book.counts()
    assert dict(counts.live) == {} and dict(counts.objects) == {} and counts.admitted[SessionKind.GRAPHICS] == 0
    refused = Call(RM_ALLOC, ROOT, ROOT, 2, GRAPHICS, SessionKind.GRAPHICS)
    assert book.undo(refused, book.commit(refused, 7, True, 0)) == []
    assert book.counts().refused[SessionKind.GRAPHICS] == 0


def test_a_decided_session_of_a_client_with_no_known_process_is_given_back_not_recorded() -> None:
    """Its client freed while the call waited for its decision and its process gone before it could be read
    again: recorded, its client (process 0) would never be found exited, so the session counted until the listener
    ended. The reservation its decision made is given back instead."""
    book = SessionBook("t", join_window_ns=1000 * MS)
    call = Call(RM_ALLOC, ROOT, ROOT, 1, GRAPHICS, SessionKind.GRAPHICS)  # owner not read: the client was known
    events = book.commit(call, 7, False, 0)
    assert [(e.action, e.kind) for e in events] == [(EventAction.ABORTED, SessionKind.GRAPHICS)]
    assert book.owners() == {} and dict(book.counts().live) == {} and book.size().clients == 0


def test_exited_and_detached_clients_release_their_sessions() -> None:
    book = SessionBook("t", join_window_ns=1000 * MS)
    for h_root, tgid in ((ROOT, 10), (ROOT + 1, 11)):
        call = Call(RM_ALLOC, h_root, h_root, 5, NVDEC, SessionKind.NVDEC, owner=(tgid, "s"), instance=0)
        book.commit(call, tgid, False, 0)
    assert book.owners() == {ROOT: (10, "s"), ROOT + 1: (11, "s")}
    assert [e.action for e in book.release([ROOT], EventAction.EXITED)] == [EventAction.EXITED]
    assert [e.action for e in book.release_all(EventAction.DETACHED)] == [EventAction.DETACHED]
    assert dict(book.counts().live) == {} and book.owners() == {}


def test_a_session_keeps_only_its_live_objects_engine_instances() -> None:
    """One decoder object kept, another allocated on each other instance in turn and freed: each joins the session
    and is dropped with its free, instance and all. Kept, a freed object's instance could not be used again, and
    with engineInstance unbounded the instances grew by one a loop (~140 B each, without end) while every bound of
    the book saw two objects at most."""
    book = SessionBook("t", join_window_ns=1000 * MS)
    for handle, instance in [(1, 0)] + [(2, 1 + i % (ENGINE_INSTANCES - 1)) for i in range(2000)]:
        call = Call(RM_ALLOC, ROOT, ROOT, handle, NVDEC, SessionKind.NVDEC, owner=(1, "s"), instance=instance)
        assert not book.needs_decision(call, 7, 0) or handle == 1  # every object after the first joins
        book.commit(call, 7, False, 0)
        if handle == 2:
            book.commit(Call(RM_FREE, ROOT, ROOT, 2), 7, False, 0)
    (session,) = book._clients[ROOT].latest.values()
    assert session.instances == {1: 0} and session.objects == {1}
    assert dict(book.counts().live) == {SessionKind.NVDEC: 1}


def test_objects_past_the_node_limit_are_not_tracked_but_sessions_are() -> None:
    book = SessionBook("t", join_window_ns=0, bounds=SessionBounds(nodes=1))
    for handle, h_class in ((1, CHANNEL), (2, CHANNEL), (3, GRAPHICS)):
        book.commit(Call(RM_ALLOC, ROOT, ROOT, handle, h_class, classify(h_class), owner=(1, "s")), 1, False, 0)
    assert book.untracked == 1 and dict(book.counts().live) == {SessionKind.GRAPHICS: 1}


def test_one_handle_named_under_ever_new_parents_keeps_one_entry() -> None:
    """A tenant naming the same handle under a new parent on every call: the book keeps where it is now, not every
    parent it ever had (that grew by ~280 bytes a call, past every bound)."""
    book = SessionBook("t", join_window_ns=0)
    for parent in range(0x1000_0000, 0x1000_0000 + 5000):
        book.commit(Call(RM_ALLOC, ROOT, parent, 0x1234, CHANNEL, owner=(1, "s")), 1, False, 0)
    client = book._clients[ROOT]
    assert client.children == {0x1000_0000 + 4999: {0x1234}} and book.size().nodes == 1


# --- decoding --------------------------------------------------------------------------------------------------------
def test_only_rm_escapes_by_ioctl_are_followed() -> None:
    assert escape_of(16, AUDIT_ARCH_X86_64, iowr(0x46, RM_ALLOC, 32)) == (RM_ALLOC, 32)
    assert escape_of(29, AUDIT_ARCH_AARCH64, iowr(0x46, RM_FREE, 16) | 0xFFFFFFFF00000000) == (RM_FREE, 16)
    assert escape_of(16, AUDIT_ARCH_X86_64, iowr(0x46, XFER, 16)) == (XFER, 16)
    assert escape_of(16, AUDIT_ARCH_X86_64, iowr(0x46, RM_CONTROL, 32)) is None
    assert escape_of(29, AUDIT_ARCH_X86_64, iowr(0x46, RM_ALLOC, 32)) is None  # shmget on x86_64


MEMORY = {
    0x1000: struct.pack("=IIIIQ", ROOT, ROOT, 7, NVDEC, 0x3000),
    0x2000: struct.pack("=IIQ", RM_ALLOC, 32, 0x1000),
    0x3000: struct.pack("=III", 12, 0, 2),
    0x4000: struct.pack("=III", ROOT, ROOT, 7),
    0x5000: struct.pack("=IIIIQ", ROOT, ROOT, 8, NVDEC, 0x6000),  # parameters unreadable
    0x7000: struct.pack("=IIIIQ", ROOT, ROOT, 9, NVDEC, 0x8000),
    0x8000: struct.pack("=III", 12, 0, ENGINE_INSTANCES),  # past any GPU's engines: no instance, joins nothing
    0xA000: struct.pack("=IIIIQ", ROOT, ROOT, 10, NVDEC, 0xB000),
    0xB000: struct.pack("=III", 12, 0, ENGINE_INSTANCES - 1),
}


def read(addr: int, size: int) -> bytes:
    if addr not in MEMORY:
        raise OSError(14, "Bad address")
    return MEMORY[addr][:size]


@pytest.mark.parametrize("enr, size, addr, expected", [
    (RM_ALLOC, 32, 0x1000, (RM_ALLOC, 7, SessionKind.NVDEC, 2)),
    (RM_ALLOC, 48, 0x1000, (RM_ALLOC, 7, SessionKind.NVDEC, 2)),  # NVOS64
    (XFER, 16, 0x2000, (RM_ALLOC, 7, SessionKind.NVDEC, 2)),  # the wrapped escape
    (RM_FREE, NVOS00_SIZE, 0x4000, (RM_FREE, 7, None, None)),
    (RM_ALLOC, 5000, 0x1000, (0, 0, None, None)),  # a size the driver refuses
    (XFER, 24, 0x2000, (0, 0, None, None)),
    (RM_ALLOC, 32, 0x9000, (0, 0, None, None)),  # unreadable: the driver answers EFAULT
    (RM_ALLOC, 32, 0x5000, (RM_ALLOC, 8, SessionKind.NVDEC, None)),
    (RM_ALLOC, 32, 0x7000, (RM_ALLOC, 9, SessionKind.NVDEC, None)),
    (RM_ALLOC, 32, 0xA000, (RM_ALLOC, 10, SessionKind.NVDEC, ENGINE_INSTANCES - 1)),
])
def test_calls_are_decoded_from_the_caller_s_memory(enr: int, size: int, addr: int, expected: tuple[object, ...]) -> None:
    call = decode_call(enr, size, addr, read)
    assert (call.op, call.handle, call.kind, call.instance) == expected


# --- the agent with fake session hooks -------------------------------------------------------------------------------
HAND_OVER = """
import sys
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.filter import install_filter
from unisched.enforce.seccomp.handover import hand_over
try:
    hand_over(install_filter(), sys.argv[1], metadata=sys.argv[2], timeout=10)
except SeccompError as e:
    print(e)
    raise SystemExit(1)
print("ok")
"""


async def _hand_overs(server: SeccompAgentServer, metadata: list[str], prefix: tuple[str, ...] = ()) -> list[str]:
    """Each hand-over's answer; `prefix`: what the handing process runs under (unshare)."""
    await server.start()
    try:
        out = []
        for m in metadata:
            proc = await asyncio.create_subprocess_exec(
                *prefix, sys.executable, "-c", HAND_OVER, server.path, m, env=child_env(), stdout=subprocess.PIPE)
            stdout, _ = await asyncio.wait_for(proc.communicate(), 30)
            out.append(stdout.decode().strip())
        return out
    finally:
        await server.close()


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
def test_the_agent_gives_each_accepted_listener_to_its_hooks_and_closes_them(tmp_path: Path) -> None:
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"),))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    hooks = FakeSessionHooks()
    server = SeccompAgentServer(str(tmp_path / "agent.sock"), engine, hooks=hooks)
    answers = asyncio.run(_hand_overs(server, ["tenant=render", "tenant=nobody"]))
    assert answers[0] == "ok"
    assert "unknown tenant 'nobody'" in answers[1]
    assert hooks.attached == ["render"], "only the accepted hand-over reaches the hooks"
    assert hooks.closed, "closing the agent closes the hooks"
    assert [s.tenant for s in hooks.stats()] == ["render"]


SEND_AND_EXIT = """
import os, socket, sys, traceback
from unisched.enforce.seccomp.filter import install_filter
from unisched.enforce.seccomp.handover import make_agent_message, send_fd
def send():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    send_fd(sock, install_filter(), make_agent_message(int(sys.argv[3]) or os.getpid(), metadata=sys.argv[2]))
count = int(sys.argv[4])
if count == 1:
    send()
else:  # a process may hold one listener: a child each, one after the other
    for _ in range(count):
        child = os.fork()
        if child == 0:
            try:
                send()
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        if os.waitpid(child, 0)[1]:
            raise SystemExit(1)
"""
"""As runc does: send the hand-over and exit without waiting for the daemon's answer. argv: the agent socket, the
metadata, the pid the message names (0: this process), how many hand-overs (one connection each; from a child
each when more than one)."""


def _agent(tmp_path: Path, engine: Scheduler, hooks: FakeSessionHooks,
           limits: HandOverLimits | None = None) -> SeccompAgentServer:
    """An agent on both sockets, each in a directory of its own (side by side, as the config check wants them)."""
    return SeccompAgentServer(str(tmp_path / "shared" / "agent.sock"), engine, hooks=hooks, limits=limits,
                              runtime_path=str(tmp_path / "runtime" / "agent.sock"))


def _after_the_sender_exited(tmp_path: Path, metadata: str, *, runtime: bool = True, pid: int = 0,
                             in_tenant: bool = False, count: int = 1,
                             limits: HandOverLimits | None = None) -> tuple[list[str], list[str]]:
    """Hand `count` listeners over as runc does, on the runtime agent socket (`runtime`) or the shared one, the
    daemon's loop held until the sender has exited and been reaped; the tenants served and the refusals' reasons
    (busy ones included). `pid`: the process the message names (0: the sender), put in tenant render's cgroup first
    if `in_tenant`."""
    tmp_path.mkdir(exist_ok=True)
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"),))
    driver = FakeCgroupDriver()
    engine = Scheduler(config, driver, NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    hooks = FakeSessionHooks()
    server = _agent(tmp_path, engine, hooks, limits)

    async def exited_before_read() -> None:
        handled = asyncio.Event()
        close = server._close
        ended = [0]

        def handled_now(*args: Any) -> None:  # each connection ends here, whether refused at accept or handled
            close(*args)
            ended[0] += 1
            if ended[0] == count:
                handled.set()

        server._close = handled_now  # type: ignore[method-assign]
        await server.start()
        try:  # the loop is held while the sender runs to its end: the daemon reads it only once it has exited
            path = server.runtime_path if runtime else server.path
            assert path is not None
            sender = subprocess.Popen([sys.executable, "-c", SEND_AND_EXIT, path, metadata, str(pid), str(count)],
                                      env=child_env())
            if in_tenant:
                driver.attach(engine.snapshot("render").cgroup, pid or sender.pid)
            assert sender.wait(30) == 0
            await asyncio.wait_for(handled.wait(), 30)
        finally:
            await server.close()

    with capture_logs() as logs:
        asyncio.run(exited_before_read())
    return hooks.attached, [str(e["reason"]) for e in logs if e["event"].startswith("seccomp hand-over refused")]


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only root may hand over on the runtime agent socket")
def test_a_runtime_gone_before_its_hand_over_is_read_is_still_served(tmp_path: Path) -> None:
    """runc sends the listener and goes on without reading an answer; under load it may have exited before the
    daemon reads the hand-over. On the runtime agent socket, which only root on the host reaches, it is still
    believed, and the container's GPU session calls are governed (not failed with ENOSYS)."""
    assert _after_the_sender_exited(tmp_path, "tenant=render") == (["render"], [])


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only root may hand over on the runtime agent socket")
def test_a_gone_runtime_s_container_is_found_by_its_cgroup_while_the_container_s_process_runs(tmp_path: Path) -> None:
    """Without listenerMetadata (Kubernetes' Localhost profiles) the tenant is the one whose cgroup holds the
    process the message names: served though the runtime is gone, if that process still runs once its cgroup was
    read (it is pinned first), so that the pid read named it."""
    alive = _after_the_sender_exited(tmp_path / "alive", "", pid=os.getpid(), in_tenant=True)
    assert alive == (["render"], [])
    attached, reasons = _after_the_sender_exited(tmp_path / "gone", "", in_tenant=True)  # names itself, reaped
    assert attached == [] and len(reasons) == 1 and "exited before its tenant was read" in reasons[0], reasons


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only root may hand over on the runtime agent socket")
def test_runtime_hand_overs_past_root_s_slots_wait_for_one_and_are_all_served(tmp_path: Path) -> None:
    """runc never reads the answer, so a "busy" refusal on the runtime agent socket would leave its container's GPU
    calls failing with ENOSYS: while root's slots are all taken, the runtime's next hand-overs wait (in the backlog)
    until one is given back, and none is refused."""
    attached, reasons = _after_the_sender_exited(tmp_path, "tenant=render", count=6, limits=HandOverLimits(root=1))
    assert (attached, reasons) == (["render"] * 6, [])


def _pidfds_of(pid: int) -> int:
    """How many pidfds of process `pid` this process holds."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]":
                held += f"\nPid:\t{pid}\n" in Path(f"/proc/self/fdinfo/{fd}").read_text()
        except OSError:
            continue  # (closed meanwhile: the listing's own fd)
    return held


def test_on_the_runtime_socket_the_named_process_is_pinned_before_its_cgroup_is_read(tmp_path: Path) -> None:
    """Without a tenant named (Kubernetes' profiles name none) the tenant is read through the cgroup of the process
    the message names. It is held by a pidfd first, so that its being alive after the read proves the pid read was
    still that process, not one given the pid after it exited."""
    pid, held = os.getpid(), []
    before = _pidfds_of(pid)

    class Engine:
        def tenant_of_pid(self, asked: int) -> str | None:
            held.append(_pidfds_of(asked) - before)
            return "render"

    server = SeccompAgentServer(str(tmp_path / "agent.sock"), cast(Scheduler, Engine()), hooks=FakeSessionHooks())
    hello = AgentHello(pid=pid, metadata="", container_id="c", status="creating", annotations={})
    runtime = PeerCred(1, 0, 0, unpinned=True)  # (the runtime, as `kernel_cred` gives it: gone for all we know)
    assert server._tenant_for(runtime, True, hello) == ("render", None)
    assert held == [1], "the process was not held while its cgroup was read"
    assert _pidfds_of(pid) == before, "and let go after"


def test_a_runtime_directory_made_before_the_daemon_stays_and_one_holding_other_files_is_refused(
        tmp_path: Path) -> None:
    """systemd's RuntimeDirectory= or a Kubernetes hostPath makes the directory before the daemon starts: narrowed to
    0700 at start, left in place at stop (only the socket goes). One that holds other files is not the daemon's to
    narrow: a configuration error naming it (exit 2)."""
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"),))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    made_before = tmp_path / "runtime"
    made_before.mkdir(mode=0o755)

    async def start_and_stop(server: SeccompAgentServer) -> int:
        try:
            await server.start()
            return stat.S_IMODE(made_before.stat().st_mode)
        finally:
            await server.close()

    assert asyncio.run(start_and_stop(_agent(tmp_path, engine, FakeSessionHooks()))) == 0o700
    assert made_before.is_dir() and list(made_before.iterdir()) == [], "left in place, its socket gone"
    (made_before / "other").touch()
    made_before.chmod(0o755)
    refused = f"config 'runtime_agent_socket': cannot use {made_before}: {made_before} holds other files \\(other\\)"
    with pytest.raises(ConfigError, match=refused):
        asyncio.run(start_and_stop(_agent(tmp_path, engine, FakeSessionHooks())))
    assert stat.S_IMODE(made_before.stat().st_mode) == 0o755 and (made_before / "other").exists()


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only root in the host's namespaces is the runtime")
def test_on_the_shared_agent_socket_a_sender_gone_before_its_hand_over_is_read_may_not_name_a_tenant(
    tmp_path: Path
) -> None:
    """Root in a pod reaches the shared socket where /run/unisched is mounted: a root peer whose namespaces can no
    longer be read (it is gone) cannot be told from it there, so it is an ordinary peer and may not name a tenant."""
    attached, reasons = _after_the_sender_exited(tmp_path, "tenant=render", runtime=False)
    assert attached == [] and len(reasons) == 1, reasons
    assert "only a root runtime in the host's namespaces may name the tenant" in reasons[0]


RUNTIME_SOCKET_AS_NOBODY = """
import os, sys
from unisched.enforce.seccomp.abi import SeccompError
from unisched.enforce.seccomp.handover import hand_over  # imported while still root (the interpreter may live in /root)
r, w = os.pipe()  # any fd: a peer that is not root is refused before its hand-over is read
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    hand_over(r, sys.argv[1], metadata="tenant=render", timeout=10)
except SeccompError as e:
    print(e)
    raise SystemExit(1)
print("ok")
"""


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the runtime agent socket is root's")
def test_the_runtime_agent_socket_is_root_s_alone_and_refuses_any_other_peer(short_dir: Path) -> None:
    """Its directory is made 0700 and the socket 0600, both root's, so no other user reaches it; and should its modes
    ever let one in, the peer's uid (SO_PEERCRED) is checked as well."""
    short_dir.chmod(0o755)  # (the shared socket's place: anyone may reach it)
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"),))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(short_dir / "state"), FakeClock())
    engine.start()
    hooks = FakeSessionHooks()
    server = _agent(short_dir, engine, hooks)
    assert server.runtime_path is not None
    runtime = Path(server.runtime_path)

    async def as_nobody() -> list[str]:
        await server.start()
        try:
            modes = [(os.stat(p).st_uid, stat.S_IMODE(os.stat(p).st_mode)) for p in (runtime.parent, runtime)]
            assert modes == [(0, 0o700), (0, 0o600)]
            answers = []
            for loosened in (False, True):
                if loosened:  # as if its modes had failed: the peer's uid still keeps it out
                    runtime.parent.chmod(0o711)
                    runtime.chmod(0o666)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", RUNTIME_SOCKET_AS_NOBODY, str(runtime), env=child_env(),
                    stdout=subprocess.PIPE)
                stdout, _ = await asyncio.wait_for(proc.communicate(), 30)
                answers.append(stdout.decode().strip())
            return answers
        finally:
            await server.close()

    kept_out, refused = asyncio.run(as_nobody())
    assert "Permission denied" in kept_out, kept_out
    assert "only root (a container runtime on the host) may hand over on the runtime agent socket" in refused, refused
    assert hooks.attached == []
    assert not runtime.parent.exists(), "the directory the daemon made goes with it"


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
@pytest.mark.parametrize("namespace", ["--pid", "--user"])
def test_root_in_another_namespace_is_no_runtime_and_may_not_name_a_tenant(tmp_path: Path, namespace: str) -> None:
    """Root inside a pod reaches the agent socket where /run/unisched is mounted: it is an ordinary peer there, not
    the runtime, so it may neither name a tenant nor hand over another process's listener."""
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"),))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    hooks = FakeSessionHooks()
    server = SeccompAgentServer(str(tmp_path / "agent.sock"), engine, hooks=hooks)
    prefix = ("unshare", namespace, "--fork", *(("--map-root-user",) if namespace == "--user" else ()))
    (answer,) = asyncio.run(_hand_overs(server, ["tenant=render"], prefix))
    assert answer != "ok" and ("may only hand over its own listener" in answer
                               or "only a root runtime in the host's namespaces may name" in answer), answer
    assert hooks.attached == []
    assert asyncio.run(_hand_overs(SeccompAgentServer(str(tmp_path / "agent2.sock"), engine, hooks=hooks),
                                   ["tenant=render"])) == ["ok"]  # the same from the host's namespaces: the runtime


@pytest.mark.skipif(probe() is not None, reason=f"seccomp user notification: {probe()}")
def test_a_tenant_s_listeners_past_the_most_served_are_refused_with_the_reason(tmp_path: Path) -> None:
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"), DeclaredTenant(name="other")))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    hooks = FakeSessionHooks(max_per_tenant=2)
    server = SeccompAgentServer(str(tmp_path / "agent.sock"), engine, hooks=hooks)
    answers = asyncio.run(_hand_overs(server, ["tenant=render"] * 3 + ["tenant=other"]))
    assert answers[:2] == ["ok", "ok"] and answers[3] == "ok"
    assert "tenant 'render' already has 2 hooked process groups" in answers[2]
    assert hooks.attached == ["render", "render", "other"]


def test_the_real_hooks_serve_at_most_so_many_listeners_of_a_tenant_and_forget_the_ended() -> None:
    """Each listener is a supervisor thread and its own bounded books: a user's hooked runs must not multiply them
    without end. Pipes stand in for the listeners (conftest.pipe_listeners)."""
    from unisched.enforce.seccomp.abi import SeccompError
    from unisched.enforce.seccomp.hooks import SupervisedHooks

    async def run() -> None:
        hooks = SupervisedHooks(lambda tenant, kind, pid: True, lambda event: None, max_per_tenant=2)
        with pipe_listeners() as listener:
            try:
                hooks.attach(listener(), "a", 0)
                hooks.attach(listener(), "a", 0)
                extra = listener()
                with pytest.raises(SeccompError, match="already has 2 hooked process groups"):
                    hooks.attach(extra, "a", 0)
                with pytest.raises(OSError):
                    os.fstat(extra)  # the refused listener is closed, not leaked
                hooks.attach(listener(), "b", 0)  # another tenant's are its own
                hooks._supervisors[0][0].close()  # one of a's process groups ended
                hooks.attach(listener(), "a", 0)
                assert sorted(s.tenant for s in hooks.stats()) == ["a", "a", "b"]
            finally:
                hooks.close()

    asyncio.run(run())


def test_the_real_hooks_serve_at_most_so_many_listeners_of_a_non_root_user_whatever_its_tenants() -> None:
    """Each listener is a supervisor thread: a user with many tenants must not start threads without end (past a
    service's task limit the daemon could start none for anyone). Root's (the container runtime's) are bounded per
    tenant only."""
    from unisched.enforce.seccomp.abi import SeccompError
    from unisched.enforce.seccomp.hooks import SupervisedHooks

    async def run() -> None:
        hooks = SupervisedHooks(lambda tenant, kind, pid: True, lambda event: None, max_per_tenant=2, max_per_user=3,
                                max_all=8)
        with pipe_listeners() as listener:
            try:
                for tenant in ("a", "b", "c"):
                    hooks.attach(listener(), tenant, 1000)
                with pytest.raises(SeccompError, match="uid 1000 already has 3 hooked process groups"):
                    hooks.attach(listener(), "d", 1000)
                hooks.attach(listener(), "d", 1001)  # another user's are its own
                for tenant in ("e", "f", "g", "h"):
                    hooks.attach(listener(), tenant, 0)  # root's: per tenant only
                hooks._supervisors[0][0].close()  # one of uid 1000's runs ended
                hooks.attach(listener(), "d", 1000)
                assert len(hooks.stats()) == 8
                with pytest.raises(SeccompError, match="already serves 8 hooked process groups"):
                    hooks.attach(listener(), "i", 0)  # root's too, past the daemon's bound for all
            finally:
                hooks.close()

    asyncio.run(run())


def test_root_in_a_container_is_named_so_in_a_listener_refusal() -> None:
    from unisched.enforce.seccomp.hooks import listener_refusal
    from unisched.transport.identity import CONTAINED_ROOT

    why = listener_refusal("t", CONTAINED_ROOT, [("t", CONTAINED_ROOT), ("u", CONTAINED_ROOT)], 9, most_per_user=2)
    assert why is not None and why.startswith("root in a container already has 2 hooked process groups")
    why = listener_refusal("t", Pod(7), [("t", Pod(7)), ("u", Pod(7)), ("v", 1000)], 9, most_per_user=2)
    assert why is not None and why.startswith("pod (pid namespace 7) already has 2 hooked process groups")


def test_a_pod_s_listeners_count_against_its_pod_s_bound_not_the_host_uid_it_runs_as(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """uid 61000 in a pod is not the host's uid 61000: the listeners a pod's process hands over fill its pod's
    per-user bounds (listeners and books, hooks.USER_BOUNDS), and the host user's run is still served. The
    hand-overs come as the agent reads them (its `_receive` stood in for), from credentials as peer_of gives them."""
    from types import SimpleNamespace

    from unisched.transport import agent

    hooks = FakeSessionHooks(max_per_user=1)
    engine = SimpleNamespace(tenant_of_pid=lambda pid: "render", note_session_hooks=lambda tenant: None)
    server = SeccompAgentServer("/nonexistent/agent.sock", cast(Scheduler, engine), hooks=hooks)
    in_pod, host = PeerCred(4242, 61000, 61000, pod=7), PeerCred(4243, 61000, 61000)

    async def hand_over(cred: PeerCred) -> None:
        async def received(conn: object, deadline: float) -> tuple[int, AgentHello]:
            r, w = os.pipe()  # stands in for the listener
            os.close(w)
            return r, AgentHello(cred.pid, "", "", "running", {})

        monkeypatch.setattr(agent, "_receive", received)
        ours, theirs = socket.socketpair()
        try:
            await server._handle(ours, cred, asyncio.get_running_loop().time() + 60, runtime=False)
        finally:
            ours.close()
            theirs.close()

    async def main() -> None:
        for cred in (in_pod, in_pod, host):
            await hand_over(cred)

    asyncio.run(main())
    assert hooks.users == [Pod(7), 61000], "the pod's second refused at its own bound, the host user's served"
