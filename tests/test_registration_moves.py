"""A registering caller's cgroup move (a write to cgroup.procs: milliseconds in the kernel) runs off the daemon's
event loop, on the move thread (scheduler.moves), while the loop serves every other call; and what else happens
meanwhile (the reaper, a removal, the caller exiting, the daemon stopping) cannot leave a tenant half made.

The move is held open by a driver whose attach waits for the test's go (threading.Event), before the write or
after it; fake cgroups, and real ones for the caller that lands and is moved back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conftest import _cleanup_cgroups, needs_freezer, subtree_for
from inproc import InProcessServer, in_process_server

from unisched.enforce.cgroups import CgroupDriver, CgroupError, FakeCgroupDriver, detect_driver
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import RegisterAsk, Scheduler, SchedulerError
from unisched.scheduler.state import StateStore
from unisched.scheduler.upkeep import MEMORY_CHECK_S
from unisched.telemetry import NoGpuTelemetry
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame

T = TypeVar("T")
WAIT_S = 30.0
"""A deadline for what the test waits on (an event, a reply), never a delay standing in for one."""
HELD = "/unisched/slow"
ORIGIN = "/elsewhere"
PID = 4242


class MovingFake(FakeCgroupDriver):
    """Fake cgroups whose move takes the pid out of the cgroup it was in, as the kernel's does."""

    def attach(self, cgroup: str, pid: int) -> None:
        was = self.pid_cgroup.get(pid)
        super().attach(cgroup, pid)
        if was is not None and was != cgroup and pid in self.pids(was):
            self.groups[was].pids.remove(pid)


class HeldMoves:
    """A cgroup driver (fake or real) whose moves into `held` wait on the move thread until `release` is set,
    before the write to cgroup.procs or (`after`) once it is made. Every other call goes to `inner`."""

    def __init__(self, inner: CgroupDriver, held: str = HELD, after: bool = False) -> None:
        self.inner = inner
        self.held = held
        self.after = after
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail: CgroupError | None = None
        """Raised by the held move (after its wait) instead of moving."""
        self.loop_thread: int | None = None
        self.move_threads: set[int] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def attach(self, cgroup: str, pid: int) -> None:
        held = cgroup == self.held
        if held:
            self.move_threads.add(threading.get_ident())
        if held and not self.after:
            self._wait()
        if held and self.fail is not None:
            raise self.fail
        self.inner.attach(cgroup, pid)
        if held and self.after:
            self._wait()

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the move"


def fake_engine(tmp_path: Path, after: bool = False) -> tuple[Scheduler, HeldMoves, MovingFake, FakeClock]:
    inner, clock = MovingFake(), FakeClock()
    inner.create(ORIGIN)
    inner.attach(ORIGIN, PID)
    driver = HeldMoves(inner, after=after)
    engine = Scheduler(DaemonConfig(), driver, NoGpuTelemetry(), StateStore(tmp_path / "state"), clock)  # type: ignore[arg-type]
    engine.start()
    return engine, driver, inner, clock


def ask(name: str = "slow", pid: int = PID, keep: bool | None = None,
        alive: Callable[[], bool] | None = None) -> RegisterAsk:
    return RegisterAsk(name, None, None, (), (), pid, 0, True, alive=alive, keep=keep)


async def entered(driver: HeldMoves) -> None:
    """Until the held move is inside attach (on the move thread)."""
    assert await asyncio.to_thread(driver.entered.wait, WAIT_S), "the move never started"


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(main())


# --- the engine, off the loop ---------------------------------------------------------------------------------


def test_the_move_runs_on_its_own_thread_and_the_tenant_is_answered_once_the_caller_is_in(tmp_path: Path) -> None:
    engine, driver, inner, _ = fake_engine(tmp_path)

    async def main() -> None:
        driver.loop_thread = threading.get_ident()
        registered = engine.start_register(ask())
        await entered(driver)
        assert not registered.done()
        assert engine.snapshot("slow").pids == ()  # the loop answers meanwhile: the tenant exists, not yet its caller
        driver.release.set()
        snap = await registered
        assert snap.name == "slow" and snap.pids == (PID,)

    run(main)
    assert driver.move_threads and driver.loop_thread not in driver.move_threads
    assert inner.cgroup_of(PID) == HELD


def test_the_reaper_leaves_a_run_tenant_whose_caller_is_being_moved_in(tmp_path: Path) -> None:
    engine, driver, inner, clock = fake_engine(tmp_path)
    engine.register("emptied", None, None, (), (), 11, 0, True, keep=False)
    inner.groups["/unisched/emptied"].pids.clear()  # its last process exited

    async def main() -> None:
        registered = engine.start_register(ask(keep=False))
        await entered(driver)
        clock.advance(MEMORY_CHECK_S + 0.01)
        engine.tick()  # the once-a-second check: "slow" shows no process yet
        assert not engine.has_tenant("emptied")  # (the check ran)
        assert engine.has_tenant("slow")
        driver.release.set()
        assert (await registered).pids == (PID,)

    run(main)
    inner.groups[HELD].pids.clear()
    clock.advance(MEMORY_CHECK_S + 0.01)
    engine.tick()
    assert not engine.has_tenant("slow")  # once in and gone again, it goes as any emptied run tenant


@pytest.mark.parametrize("after", [False, True], ids=["before-the-write", "after-the-write"])
def test_a_tenant_removed_during_the_move_stays_removed_and_the_registration_fails(tmp_path: Path,
                                                                                   after: bool) -> None:
    engine, driver, inner, clock = fake_engine(tmp_path, after=after)

    async def main() -> SchedulerError:
        registered = engine.start_register(ask())
        await entered(driver)
        engine.remove("slow")  # an admin's Remove, answered while the move is held
        driver.release.set()
        with pytest.raises(SchedulerError) as e:
            await registered
        return e.value

    err = run(main)
    assert err.kind == "not_found" and "removed while its caller was being moved in" in str(err)
    assert not engine.has_tenant("slow")
    assert inner.cgroup_of(PID) == ORIGIN  # never moved, or moved back where it came from
    assert HELD not in inner.groups  # no cgroup left behind
    clock.advance(MEMORY_CHECK_S + 0.01)
    engine.tick()
    assert not engine.has_tenant("slow")
    assert "slow" not in {t.name for t in StateStore(tmp_path / "state").load()}


def test_a_caller_that_exits_during_the_move_is_refused(tmp_path: Path) -> None:
    engine, driver, inner, _ = fake_engine(tmp_path)
    gone = threading.Event()

    async def main() -> SchedulerError:
        registered = engine.start_register(ask(alive=lambda: not gone.is_set()))
        await entered(driver)
        gone.set()  # the caller exits; its pid may name another process by the time it is written
        driver.release.set()
        with pytest.raises(SchedulerError) as e:
            await registered
        return e.value

    err = run(main)
    assert (err.kind, str(err)) == ("failed", "the connecting process has exited")
    # whoever holds the pid now is not the caller: not put where the caller came from (its parent's cgroup is where
    # it goes, below; this pid names no process here, so it has none)
    assert inner.cgroup_of(PID) != ORIGIN


def test_a_failed_move_gives_the_same_error_on_the_loop_and_off_it(tmp_path: Path) -> None:
    engine, driver, _, _ = fake_engine(tmp_path)
    driver.fail = CgroupError("no space left on device")
    driver.release.set()
    with pytest.raises(SchedulerError) as inline:
        engine.register("slow", None, None, (), (), PID, 0, True)

    async def main() -> SchedulerError:
        with pytest.raises(SchedulerError) as e:
            await engine.start_register(ask())
        return e.value

    off = run(main)
    assert (inline.value.kind, str(inline.value)) == (off.kind, str(off))
    assert off.kind == "failed" and str(off) == f"cannot move pid {PID} into {HELD}: no space left on device"


class HeldLookup(HeldMoves):
    """Fake cgroups whose read of where `pid` sits (/proc/<pid>/cgroup: it waits for the kernel's cgroup lock
    while a move holds it) waits until `release` is set; moves go on at once, and are listed (`attached`)."""

    attached: list[tuple[str, int]]

    def attach(self, cgroup: str, pid: int) -> None:
        self.attached.append((cgroup, pid))
        self.inner.attach(cgroup, pid)

    def cgroup_of(self, pid: int) -> str | None:
        if pid == PID:
            self.move_threads.add(threading.get_ident())
            self._wait()
        return self.inner.cgroup_of(pid)


@pytest.mark.parametrize("member", [False, True], ids=["joins", "member"])
def test_a_known_tenants_caller_is_located_off_the_loop(tmp_path: Path, member: bool) -> None:
    """Registering with a known tenant reads where the caller sits (is it a member already?) on the move thread:
    the loop answers meanwhile, and the registration goes on with what was read (a member is not moved)."""
    inner, clock = MovingFake(), FakeClock()
    inner.create(ORIGIN)
    inner.attach(ORIGIN, PID)
    driver = HeldLookup(inner)
    driver.attached = []
    engine = Scheduler(DaemonConfig(), driver, NoGpuTelemetry(), StateStore(tmp_path / "state"), clock)  # type: ignore[arg-type]
    engine.start()
    engine.register("slow", None, None, (), (), 11, 0, True)
    if member:
        inner.attach(HELD, PID)
    driver.attached.clear()

    async def main() -> None:
        driver.loop_thread = threading.get_ident()
        registered = engine.start_register(ask())
        await entered(driver)
        assert not registered.done()
        assert engine.snapshot("slow").name == "slow"  # the loop answers while the read waits
        driver.release.set()
        snap = await registered
        assert PID in snap.pids

    run(main)
    assert driver.move_threads and driver.loop_thread not in driver.move_threads
    assert inner.cgroup_of(PID) == HELD
    assert driver.attached == ([] if member else [(HELD, PID)])  # a member is not moved


def test_registrations_are_refused_once_the_engine_stopped(tmp_path: Path) -> None:
    engine, _, _, _ = fake_engine(tmp_path)
    engine.shutdown()

    async def main() -> None:
        with pytest.raises(SchedulerError, match="stopping"):
            engine.start_register(ask())

    run(main)
    assert not engine.has_tenant("slow")


def test_moves_waiting_take_turns_by_uid_and_a_failed_one_raises_on_the_loop() -> None:
    """One user's burst of moves delays another user's by one move, not by all of theirs (FIFO fails this)."""
    from unisched.scheduler.moves import MoveThread

    async def main() -> tuple[list[str], BaseException | None]:
        mover, started, gate, order = MoveThread(), threading.Event(), threading.Event(), list[str]()

        def job(name: str) -> Callable[[], str]:
            def run() -> str:
                if name == "blocker":
                    started.set()
                    gate.wait(30)
                if name == "bad":
                    raise CgroupError("no such cgroup")
                order.append(name)
                return name
            return run

        first = mover.submit(job("blocker"), 0)
        assert started.wait(30)  # the thread is busy: what comes next waits in its uid's queue
        futures = [mover.submit(job(f"a{i}"), 1000) for i in range(4)]
        futures += [mover.submit(job("b0"), 1001), mover.submit(job("bad"), 1002)]
        gate.set()
        got = await asyncio.gather(first, *futures, return_exceptions=True)
        mover.close()
        return order, next((g for g in got if isinstance(g, BaseException)), None)

    order, error = asyncio.run(main())
    assert order == ["blocker", "a0", "b0", "a1", "a2", "a3"]
    assert isinstance(error, CgroupError)


@pytest.mark.parametrize("door", ["register", "lease"])
def test_a_pod_s_cgroup_reads_and_moves_take_its_pod_s_turns(tmp_path: Path, door: str) -> None:
    """uid 61000 in a pod is not the host's uid 61000: the reads its registrations make on the move thread (where it
    is, to join the adopted tenant whose cgroup holds it: a pod's process is never moved) wait in its pod's place in
    the rotation, not in that host user's. Asked through the transport, with credentials as peer_of gives a pod's
    process."""
    from test_pacing import Transport, lease_hello

    from unisched.policy.callers import Pod
    from unisched.transport.frontdoor import StreamLimits
    from unisched.transport.grpcdoor import Call
    from unisched.transport.identity import PeerCred
    from unisched.transport.lease import LeaseConnection, LeaseService
    from unisched.transport.pacing import Pacer
    from unisched.transport.server import UnischedServicer

    engine, driver, _, _ = fake_engine(tmp_path)
    driver.release.set()  # no move is held here
    mover, turns = engine._c.mover, list[object]()
    submit = mover.submit

    def counted(work: Callable[[], T], turn: object = 0) -> asyncio.Future[T]:
        turns.append(turn)
        return submit(work, turn)  # type: ignore[arg-type]

    mover.submit = counted  # type: ignore[method-assign]
    cred = PeerCred(PID + 1, 61000, 61000, pod=7)  # (no /proc is read for it: nothing pinned, a fake cgroup driver)
    driver.inner.create("/kubepods/pod7")
    driver.inner.attach("/kubepods/pod7", cred.pid)
    engine.adopt("pod", 10, None, "/kubepods/pod7", (), ())

    async def main() -> None:
        pacer = Pacer(asyncio.get_running_loop().call_soon)
        for _ in range(2):
            if door == "register":
                servicer = UnischedServicer(engine, None, 0.0, "fake", "/", False, pacer)
                await servicer.Register(pb.RegisterRequest(tenant="pod"), Call(cred))
                continue
            service = LeaseService(engine, lambda cred: False, pacer)
            conn = LeaseConnection(service, cred, b"", asyncio.get_running_loop().create_future(),
                                   StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True))
            conn.connection_made(Transport())
            conn.data_received(lease_hello("pod"))
            assert conn.opening is not None
            await conn.opening  # (the loop has turned meanwhile: the next hello takes a turn at once)

    run(main)
    assert turns == [Pod(7), Pod(7)]


# --- a real daemon's loop --------------------------------------------------------------------------------------


@contextlib.contextmanager
def held_server(tmp_path: Path) -> Iterator[tuple[InProcessServer, HeldMoves]]:
    driver = HeldMoves(MovingFake())
    try:
        with in_process_server(tmp_path / "state", driver=driver) as s:  # type: ignore[arg-type]
            yield s, driver
    finally:
        driver.release.set()


class LeaseStream:
    """A lease connection by hand: frames out, replies in."""

    def __init__(self, path: str, tenant: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_S)
        self.sock.connect(path)
        self.reader = FrameReader(MAX_REPLY_BYTES)
        self.replies: list[pb.LeaseReply] = []
        self.sock.sendall(MAGIC + frame(pb.LeaseRequest(seq=1, hello=pb.LeaseHello(tenant=tenant))))

    def reply(self) -> pb.LeaseReply:
        while not self.replies:
            self.replies += [pb.LeaseReply.FromString(p) for p in self.reader.feed(self.sock.recv(1 << 16))]
        return self.replies.pop(0)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("door", ["register", "lease"])
def test_the_loop_serves_other_calls_while_a_callers_move_is_held(tmp_path: Path, door: str) -> None:
    """A move made on the loop would hold every call until it ends: the status call and the renewal would time out."""
    with held_server(tmp_path) as (server, driver):
        other = LeaseStream(server.lease_socket, "other")  # a session open before
        assert other.reply().WhichOneof("kind") == "welcome"
        done: list[object] = []
        slow: LeaseStream | None = None
        if door == "register":
            def register() -> None:
                with DaemonClient(server.socket, timeout=WAIT_S) as c:
                    done.append(c.register(pb.RegisterRequest(tenant="slow", keep=True)))

            caller = threading.Thread(target=register)
            caller.start()
        else:
            slow = LeaseStream(server.lease_socket, "slow")
        try:
            assert driver.entered.wait(WAIT_S)
            with DaemonClient(server.socket, timeout=5.0) as c:
                assert c.status().tenants == 2  # answered now: "slow" exists, its caller on its way in
            other.sock.sendall(frame(pb.LeaseRequest(seq=2, want=pb.LeaseWant(engine="compute"))))
            ack = other.reply()
            while ack.WhichOneof("kind") != "ack":
                ack = other.reply()
            assert ack.seq == 2
            assert not done and server.driver.pids(HELD) == []
        finally:
            driver.release.set()
        if slow is not None:
            assert slow.reply().WhichOneof("kind") == "welcome"
            slow.close()
        else:
            caller.join(WAIT_S)
            assert len(done) == 1
        assert server.driver.pids(HELD) == [os.getpid()]
        other.close()


def test_the_daemon_stops_while_a_move_is_held(tmp_path: Path) -> None:
    failed: list[BaseException] = []

    def register(path: str) -> None:
        try:
            with DaemonClient(path, timeout=WAIT_S) as c:
                c.register(pb.RegisterRequest(tenant="slow"))
        except DaemonError as e:
            failed.append(e)

    driver = HeldMoves(MovingFake())
    try:
        with in_process_server(tmp_path / "state", driver=driver) as server:  # type: ignore[arg-type]
            caller = threading.Thread(target=register, args=(server.socket,))
            caller.start()
            assert driver.entered.wait(WAIT_S)
        # in_process_server stopped the daemon and closed its loop (which raises while serve_async still runs)
        assert server.loop.is_closed()
        assert not driver.release.is_set()  # with the move still held
        caller.join(WAIT_S)
        assert not caller.is_alive() and failed  # the call ended with the daemon, unanswered
    finally:
        driver.release.set()


# --- real cgroups ------------------------------------------------------------------------------------------------


@needs_freezer
@pytest.mark.root
def test_a_real_caller_moved_in_while_its_tenant_is_removed_goes_back(tmp_path: Path, tenant_prefix: str) -> None:
    real = detect_driver("auto", subtree_for(tenant_prefix))
    cgroup = real.tenant_cgroup("slow")
    driver = HeldMoves(real, held=cgroup, after=True)
    engine = Scheduler(DaemonConfig(), driver, NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())  # type: ignore[arg-type]
    engine.start()
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        origin = real.cgroup_of(child.pid)

        async def main() -> SchedulerError:
            registered = engine.start_register(ask(pid=child.pid))
            await entered(driver)
            assert real.cgroup_of(child.pid) == cgroup  # the write is made: the caller is in
            engine.remove("slow")
            driver.release.set()
            with pytest.raises(SchedulerError) as e:
                await registered
            return e.value

        err = run(main)
        assert err.kind == "not_found"
        assert real.cgroup_of(child.pid) == origin
        assert not real.exists(cgroup)
    finally:
        driver.release.set()
        child.kill()
        child.communicate()
        engine.shutdown()
        _cleanup_cgroups(tenant_prefix)



def test_a_pid_reused_during_a_move_goes_to_its_parent_s_cgroup_not_the_caller_s_origin() -> None:
    """The caller exited and its pid named a stranger by the time the kernel moved it: the stranger leaves the
    tenant for where a new process starts (its parent's cgroup), never for the caller's cgroup of origin, which the
    caller chose (a cgroup of its own it may freeze)."""
    import subprocess

    from unisched.enforce.cgroups import FakeCgroupDriver
    from unisched.scheduler.moves import Move, move_caller
    from unisched.scheduler.tenant import SchedulerError

    driver = FakeCgroupDriver()
    for cg in ("/attacker", "/parent", "/unisched/t"):
        driver.create(cg)
    driver.attach("/parent", os.getpid())  # the stranger's parent: this test's process
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        driver.attach("/attacker", stranger.pid)  # where the caller, holding this pid before, came from
        checks = iter((True, False))  # alive when asked before the move, gone after it
        with pytest.raises(SchedulerError):
            move_caller(Move(driver, "/unisched/t", stranger.pid, alive=lambda: next(checks)))
        assert driver.cgroup_of(stranger.pid) == "/parent"
    finally:
        stranger.kill()
        stranger.wait(10)
