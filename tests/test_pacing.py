"""What one turn of the daemon's event loop may do, so that no burst holds the loop (and every tenant's lease
renewals) for seconds: registrations and tenant listings take about one turn each, in order (transport.pacing);
one connection's requests are answered ANSWERED_PER_TURN a turn; decisions past the first DECISIONS_PER_TURN of a
turn fold into one at its end (scheduler.tick.reschedule). The pacer's turns are driven by hand, then against a
real loop and real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from inproc import InProcessServer, in_process_server

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.leases import FakeLeaseChannel
from unisched.policy import Decision
from unisched.policy.callers import Caller, Pod
from unisched.scheduler.clock import SystemClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.scheduler.tick import DECISIONS_PER_TURN
from unisched.telemetry import NoGpuTelemetry
from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import Call
from unisched.transport.identity import PeerCred
from unisched.transport.lease import ANSWERED_PER_TURN, LeaseConnection, LeaseService
from unisched.transport.pacing import Pacer
from unisched.transport.server import UnischedServicer
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame


class Loop:
    """call_soon's queue; `turn()` runs what was queued before it, as one turn of an asyncio loop does."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], None]] = []

    def call_soon(self, cb: Callable[[], None]) -> None:
        self.ready.append(cb)

    def turn(self) -> None:
        now, self.ready = self.ready, []
        for cb in now:
            cb()


def count_turns(loop: asyncio.AbstractEventLoop) -> list[int]:
    """[n]: how many turns the loop has begun since (a callback that runs once a turn and queues itself again)."""
    turns = [0]

    def count() -> None:
        turns[0] += 1
        loop.call_soon(count)

    loop.call_soon_threadsafe(count)
    return turns


def registrar(log: list[str], name: str, alive: bool = True) -> Callable[[], bool]:
    def run() -> bool:
        if alive:
            log.append(name)
        return alive

    return run


def test_the_first_registration_of_a_turn_runs_at_once_and_the_next_waits() -> None:
    loop = Loop()
    p = Pacer(loop.call_soon)
    assert p.take()
    assert not p.take()
    loop.turn()
    assert p.take()  # a new turn, nobody waiting


def test_waiting_registrations_run_one_per_turn_in_the_order_they_came() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    assert p.take()
    for name in "abc":
        p.queue(registrar(log, name), 1000)
    assert not p.take()  # nobody jumps the queue, even in a turn of its own
    seen = []
    for _ in range(4):
        loop.turn()
        seen.append("".join(log))
    assert seen == ["a", "ab", "abc", "abc"]
    loop.turn()
    assert p.take() and p.waiting == 0


def test_users_take_turns_so_that_one_users_burst_delays_another_by_one_registration() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    assert p.take()
    for i in range(4):
        p.queue(registrar(log, f"a{i}"), 1000)
    p.queue(registrar(log, "b0"), 1001)
    p.queue(registrar(log, "b1"), 1001)
    p.queue(registrar(log, "c0"), 1002)
    assert p.waiting == 7
    for _ in range(8):
        loop.turn()
    assert log == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert p.waiting == 0


def test_a_caller_gone_while_it_waited_leaves_its_turn_to_the_next() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    assert p.take()
    p.queue(registrar(log, "gone", alive=False), 1000)
    p.queue(registrar(log, "b"), 1000)
    loop.turn()
    assert log == ["b"]


def test_a_registration_that_raises_does_not_stop_the_queue() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)

    def boom() -> bool:
        raise RuntimeError("boom")

    assert p.take()
    p.queue(boom, 1000)
    p.queue(registrar(log, "b"), 1000)
    with pytest.raises(RuntimeError):
        loop.turn()
    loop.turn()
    assert log == ["b"]


def test_a_queue_with_no_turn_taken_still_starts() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    p.queue(registrar(log, "a"), 1000)
    loop.turn()
    assert log == ["a"]


def test_awaiting_callers_register_one_turn_apart() -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        p = Pacer(loop.call_soon)
        turns = count_turns(loop)
        at: list[int] = []

        async def register() -> None:
            await p.turn(1000)
            at.append(turns[0])

        tasks = [asyncio.ensure_future(register()) for _ in range(5)]
        await asyncio.sleep(0)
        tasks[2].cancel()  # gone while it waited
        await asyncio.gather(*tasks, return_exceptions=True)
        return at

    at = asyncio.run(main())
    assert len(at) == 4
    assert all(b > a for a, b in itertools.pairwise(at)), at


def test_callers_that_queue_and_give_up_leave_nothing_queued_behind() -> None:
    """A user who opens calls and cancels them at once, turn after turn, while another user's calls wait: the
    cancelled ones leave the queue at once (else one entry a turn is served and the queue grows without bound)."""
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        p = Pacer(loop.call_soon)
        assert p.take()
        live = [asyncio.ensure_future(p.turn(1)) for _ in range(4)]
        most = 0
        for _ in range(200):
            cancelled = [asyncio.ensure_future(p.turn(2)) for _ in range(50)]
            await asyncio.sleep(0)  # each is queued
            for t in cancelled:
                t.cancel()
            await asyncio.gather(*cancelled, return_exceptions=True)
            most = max(most, p.waiting)
            live = [t for t in live if not t.done()] + [asyncio.ensure_future(p.turn(1))]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)
        return most, p.waiting

    most, left = asyncio.run(main())
    assert most <= 6, most  # uid 1's few live callers, nothing of uid 2's
    assert left == 0


# the lease stream's hellos, against a real loop and real sockets ---------------------------------------------------

HELLOS = 24


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state") as s:
        yield s


@contextlib.contextmanager
def loop_held(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """The daemon's loop stopped inside one callback until the block ends: what the clients send meanwhile is
    all there at its next select, as a burst is."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(30)

    loop.call_soon_threadsafe(hold)
    assert holding.wait(30)
    try:
        yield
    finally:
        release.set()


def test_a_burst_of_lease_hellos_registers_one_per_loop_turn(server: InProcessServer) -> None:
    loop = server.loop
    turn = count_turns(loop)
    opened_in: list[int] = []
    start_lease_open = server.engine.start_lease_open

    def counted_open(*args: object, **kwargs: object) -> object:
        opened_in.append(turn[0])
        return start_lease_open(*args, **kwargs)  # type: ignore[arg-type]

    server.engine.start_lease_open = counted_open  # type: ignore[method-assign, assignment]
    socks = []
    try:
        for _ in range(HELLOS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            socks.append(s)
        with loop_held(loop):
            for i, s in enumerate(socks):
                s.connect(server.lease_socket)
                s.sendall(MAGIC + frame(pb.LeaseRequest(seq=1, hello=pb.LeaseHello(tenant=f"burst-{i}"))))
        for s in socks:
            reader, replies = FrameReader(MAX_REPLY_BYTES), list[pb.LeaseReply]()
            while not replies:
                replies += [pb.LeaseReply.FromString(p) for p in reader.feed(s.recv(1 << 16))]
            assert replies[0].WhichOneof("kind") == "welcome", replies[0]
    finally:
        for s in socks:
            s.close()
    assert len(opened_in) == HELLOS
    assert len(set(opened_in)) == HELLOS, f"turns of the registrations: {opened_in}"


# a lease connection that waits for its turn ---------------------------------------------------------------------


class Transport(asyncio.Transport):
    """What LeaseConnection uses of its transport, recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.reading = True
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def replies(self) -> list[str]:
        return [pb.LeaseReply.FromString(p).WhichOneof("kind") or "" for p in FrameReader(MAX_REPLY_BYTES).feed(
            bytes(self.written))]


Connect = Callable[..., tuple[LeaseConnection, Transport]]
"""A lease connection (of root's in the host's namespaces, or of the PeerCred given)."""


@contextlib.contextmanager
def lease_connections(tmp_path: Path, adopted: Mapping[str, tuple[int, ...]] | None = None,
                      ) -> Iterator[tuple[Loop, Connect, list[int]]]:
    """Connections of one real engine (fake cgroups) whose pacer's turns the test drives; `held` is the uid's
    budget as the front door keeps it. `adopted`: tenants an admin adopted, each with the pids its cgroup holds
    (a pod's processes, which may join only such a tenant)."""
    config = DaemonConfig(socket=str(tmp_path / "s.sock"), state_dir=str(tmp_path / "state"))
    driver = FakeCgroupDriver()
    engine = Scheduler(config, driver, NoGpuTelemetry(), StateStore(config.state_dir, driver.subtree), SystemClock())
    for name, pids in (adopted or {}).items():
        driver.create(f"/kubepods/{name}")
        for pid in pids:
            driver.attach(f"/kubepods/{name}", pid)
        engine.adopt(name, 10, None, f"/kubepods/{name}", (), ())
    loop, held = Loop(), [0]
    service = LeaseService(engine, lambda cred: True, Pacer(loop.call_soon))

    def hold(delta: int) -> bool:
        held[0] += delta
        return held[0] <= 4096

    def connect(cred: PeerCred | None = None) -> tuple[LeaseConnection, Transport]:
        aloop = asyncio.get_running_loop()
        conn = LeaseConnection(service, cred or PeerCred(os.getpid(), 0, 0), b"", aloop.create_future(),
                               StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=hold))
        t = Transport()
        conn.connection_made(t)
        return conn, t

    yield loop, connect, held


def payload_bytes(frames: bytes) -> int:
    return sum(map(len, FrameReader(MAX_REPLY_BYTES).feed(frames)))


def lease_hello(tenant: str) -> bytes:
    return frame(pb.LeaseRequest(seq=1, hello=pb.LeaseHello(tenant=tenant)))


def want(seq: int) -> bytes:
    return frame(pb.LeaseRequest(seq=seq, want=pb.LeaseWant(engine="compute")))


def test_a_hello_that_waits_is_answered_in_its_turn_with_what_came_after_it(tmp_path: Path) -> None:
    async def main() -> None:
        with lease_connections(tmp_path) as (loop, connect, held):
            (a, ta), (b, tb) = connect(), connect()
            a.data_received(lease_hello("first"))
            b.data_received(lease_hello("second") + want(2) + want(3)[:5])  # and the start of one more
            assert a.opening is not None
            await a.opening  # (its caller is moved in off the loop)
            assert ta.replies() == ["welcome"]
            assert tb.replies() == [] and not tb.reading  # its turn is the next: nothing more is read meanwhile
            assert held[0] == payload_bytes(lease_hello("second") + want(2)) + 5
            loop.turn()
            assert b.opening is not None
            await b.opening
            assert tb.replies()[:2] == ["welcome", "ack"] and tb.reading
            assert held[0] == 5  # only the unfinished frame now
            b.data_received(want(3)[5:])
            assert held[0] == 0 and tb.replies().count("ack") == 2

    asyncio.run(main())


def test_a_connection_that_closes_while_it_waits_gives_its_bytes_and_its_turn_back(tmp_path: Path) -> None:
    async def main() -> None:
        with lease_connections(tmp_path) as (loop, connect, held):
            (a, _), (b, tb), (c, tc) = connect(), connect(), connect()
            a.data_received(lease_hello("first"))
            b.data_received(lease_hello("gone"))
            c.data_received(lease_hello("third"))
            b.connection_lost(None)
            assert held[0] == payload_bytes(lease_hello("third"))
            loop.turn()
            assert b.opening is None and c.opening is not None
            await c.opening
            assert tb.replies() == [] and tc.replies() == ["welcome"]
            assert held[0] == 0

    asyncio.run(main())


def test_an_unfinished_frame_after_a_wait_still_has_its_deadline(tmp_path: Path) -> None:
    async def main() -> None:
        with lease_connections(tmp_path) as (loop, connect, _):
            (a, _), (b, _) = connect(), connect()
            a.data_received(lease_hello("first"))
            b.data_received(lease_hello("second") + want(2)[:3])
            loop.turn()
            assert b.opening is not None
            await b.opening
            assert b._timer is not None  # the partial frame's deadline (it ends the stream when it passes)

    asyncio.run(main())


def toggle(seq: int) -> bytes:
    """A want and a release, each acked: what a client flooding the daemon with demand changes sends."""
    return want(seq) + frame(pb.LeaseRequest(seq=seq + 1, report=pb.LeaseReport(engine="compute", release=True)))


def test_one_read_full_of_requests_is_answered_over_several_loop_turns(tmp_path: Path) -> None:
    async def main() -> None:
        with lease_connections(tmp_path) as (_, connect, held):
            a, ta = connect()
            a.data_received(lease_hello("flood") + b"".join(toggle(2 + 2 * i) for i in range(50)))  # 101 requests
            assert a.opening is not None and ta.replies() == [] and not ta.reading  # the rest waits for the welcome
            await a.opening
            # the welcome, and as many as one turn answers of the 100 that came after it
            assert len(ta.replies()) - ta.replies().count("grant") - ta.replies().count("revoke") == 1 + ANSWERED_PER_TURN
            assert not ta.reading and held[0] > 0
            turns = 0
            while not ta.reading:
                await asyncio.sleep(0)
                turns += 1
            assert turns == 100 // ANSWERED_PER_TURN
            answered = [k for k in ta.replies() if k in ("welcome", "ack")]
            assert len(answered) == 101 and held[0] == 0

    asyncio.run(main())


def test_decisions_past_the_first_few_of_a_loop_turn_fold_into_one_at_its_end(tmp_path: Path) -> None:
    config = DaemonConfig(socket=str(tmp_path / "s.sock"), state_dir=str(tmp_path / "state"))
    driver = FakeCgroupDriver()
    engine = Scheduler(config, driver, NoGpuTelemetry(), StateStore(config.state_dir, driver.subtree), SystemClock())
    engine.start()
    loop = Loop()
    engine.fold_decisions(loop.call_soon)
    sessions = [engine.lease_open(f"t{i}", 100, None, ["compute"], 0, os.getpid(), 0, True, FakeLeaseChannel())[0]
                for i in range(DECISIONS_PER_TURN + 3)]
    loop.turn()
    decided = [0]
    decide = engine.policy.decide

    def counted(now: float) -> Decision:
        decided[0] += 1
        return decide(now)

    engine.policy.decide = counted  # type: ignore[method-assign]
    for sid in sessions:
        engine.lease_want(sid, "compute")
    assert decided[0] == DECISIONS_PER_TURN  # the first few at once
    loop.turn()
    assert decided[0] == DECISIONS_PER_TURN + 1  # the other three as one, when the turn ended
    loop.turn()
    assert decided[0] == DECISIONS_PER_TURN + 1 and not loop.ready  # nothing more was due
    engine.lease_want(sessions[0], "compute")  # (already wanted: no change, no decision)
    engine.lease_report(sessions[0], "compute", 0.0, True)
    assert decided[0] == DECISIONS_PER_TURN + 2  # a new turn: at once again


def test_concurrent_tenant_listings_take_turns(tmp_path: Path) -> None:
    """Listing every tenant costs as much as a registration: listings at once are paced as hellos are."""
    config = DaemonConfig(socket=str(tmp_path / "s.sock"), state_dir=str(tmp_path / "state"))
    driver = FakeCgroupDriver()
    engine = Scheduler(config, driver, NoGpuTelemetry(), StateStore(config.state_dir, driver.subtree), SystemClock())
    engine.start()

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        servicer = UnischedServicer(engine, None, 0.0, "fake", "/", False, Pacer(loop.call_soon))
        turn = count_turns(loop)
        listed_in: list[int] = []
        snapshots = engine.snapshots

        def counted(*args: object, **kwargs: object) -> object:
            listed_in.append(turn[0])
            return snapshots(*args, **kwargs)  # type: ignore[arg-type]

        engine.snapshots = counted  # type: ignore[method-assign, assignment]
        await asyncio.gather(*(servicer.ListTenants(pb.ListTenantsRequest(), Call(None)) for _ in range(5)))
        return listed_in

    listed_in = asyncio.run(main())
    assert len(listed_in) == 5 and len(set(listed_in)) == 5, f"turns of the listings: {listed_in}"


def test_a_pod_s_hellos_wait_in_its_pod_s_place_not_in_that_of_the_host_uid_it_runs_as(tmp_path: Path) -> None:
    """uid 61000 in a pod is not the host's uid 61000: a pod's burst of hellos delays that host user's hello by one
    turn, not by the whole burst."""
    pod_pids = (424201, 424202, 424203)  # a pod's processes, in its adopted cgroup (no /proc is read for them)

    async def main() -> None:
        with lease_connections(tmp_path, {"pod": pod_pids}) as (loop, connect, _held):
            first, _ = connect()
            pod = [connect(PeerCred(pid, 61000, 61000, pod=7))[0] for pid in pod_pids]
            host, _ = connect(PeerCred(os.getpid(), 61000, 61000))
            first.data_received(lease_hello("first"))  # this turn's
            for conn in pod:
                conn.data_received(lease_hello("pod"))
            host.data_received(lease_hello("host"))
            opened = [first.opening]
            loop.turn()
            loop.turn()  # (nothing is awaited meanwhile: each opening stays set until its move is done)
            assert [c.opening is not None for c in (*pod, host)] == [True, False, False, True]
            loop.turn()
            loop.turn()
            opened += [c.opening for c in (*pod, host)]
            assert all(o is not None for o in opened)
            await asyncio.gather(*opened)

    asyncio.run(main())


def test_a_pod_s_registration_and_listing_take_its_pod_s_turn() -> None:
    """The gRPC calls that take turns with the registrations ask for the turn of the caller as the books count it:
    a pod's, for a pod's process whatever uid it runs as."""
    class Turns(Pacer):
        def __init__(self) -> None:
            super().__init__(lambda cb: None)
            self.asked: list[object] = []

        async def turn(self, caller: Caller) -> None:
            self.asked.append(caller)
            raise RuntimeError("asked")  # (enough: the call goes no further)

    pacer = Turns()
    engine = SimpleNamespace(devices=None, mps_status=lambda: None)
    servicer = UnischedServicer(cast(Scheduler, engine), None, 0.0, "fake", "/", False, pacer)
    call = Call(PeerCred(os.getpid(), 61000, 61000, pod=7))

    async def main() -> None:
        for ask in (servicer.Register(pb.RegisterRequest(tenant="t"), call),
                    servicer.RemoveTenant(pb.RemoveTenantRequest(tenant="t"), call),
                    servicer.ListTenants(pb.ListTenantsRequest(), call)):
            with pytest.raises(RuntimeError, match="asked"):
                await ask

    asyncio.run(main())
    assert pacer.asked == [Pod(7)] * 3


def test_a_connection_that_ends_while_its_hello_waits_leaves_the_queue(tmp_path: Path) -> None:
    async def main() -> None:
        with lease_connections(tmp_path) as (_loop, connect, _held):
            (a, _ta), (b, _tb) = connect(), connect()
            a.data_received(lease_hello("first"))
            b.data_received(lease_hello("second"))
            pacer = b.service.pacer
            assert pacer.waiting == 1
            b.connection_lost(None)
            assert pacer.waiting == 0
            assert a.opening is not None
            await a.opening

    asyncio.run(main())
