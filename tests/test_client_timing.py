"""The client's timing on a FakeClock, against a fake lease peer on a real Unix socket speaking the wire protocol.

Renewal intervals, idle releases, acquire timeouts, slice ends, the reconnect back-off and the ack and registration
timeouts all wait through the injected clock: each test parks a client thread in a fake wait
(`FakeClock.await_sleep`), checks what was (not) sent, advances the clock, and reads what the client then sent.
Nothing sleeps; a thread parked on the fake clock cannot move until the test advances it or a reply arrives.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "clients"))  # this checkout's client library, not an installed one
from unisched_client import Client, UnischedError, UnischedUnavailable
from unisched_client.clock import FakeClock, SystemClock
from unisched_client.gate import START_GRACE_S, Gate, Start, may_start
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REQUEST_BYTES, FrameReader, frame

STREAM, RENEW, APP = "unisched-lease-stream", "unisched-lease-renew", "app"
SLICE_S, VALID_S = 0.0625, 0.375
"""The welcome's slice and lease term (binary fractions, so that advancing the fake clock by them is exact)."""
EPS = 1 / 1024
"""A step of the fake clock that keeps sums of the steps above exact."""
QUIET = {"renew_interval": 100.0}
"""For tests of another thread's waits: the renew thread, parked on the same condition, is never due (a due wait's
wake-up wakes every waiter on the condition, which then waits again: harmless, but it would count as a new wait)."""
LIMIT_S = 30.0
"""Real seconds a test waits for something that happens (a reply read, a thread parked): generous, for a busy host."""


class Peer:
    """A lease peer on a Unix socket: welcomes each hello (unless `mute`), queues every other request it reads,
    and sends what the test says to the latest connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.requests: queue.SimpleQueue[pb.LeaseRequest] = queue.SimpleQueue()
        self.connections = 0
        self.mute = False
        """Accept, read the hello, and close without an answer (a daemon going away)."""
        self.silent = False
        """Accept, read, and never answer (a daemon too busy to register us)."""
        self._conn: socket.socket | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                self.connections += 1
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            got = b""
            while len(got) < len(MAGIC):
                chunk = conn.recv(len(MAGIC) - len(got))
                if not chunk:
                    return
                got += chunk
            assert got == MAGIC
            reader = FrameReader(MAX_REQUEST_BYTES)
            while data := conn.recv(1 << 16):
                for payload in reader.feed(data):
                    req = pb.LeaseRequest.FromString(payload)
                    if req.HasField("hello"):
                        self.requests.put(req)
                        if self.mute:
                            return
                        if not self.silent:
                            self._conn = conn
                            self.send(pb.LeaseReply(welcome=pb.LeaseWelcome(
                                tenant=pb.Tenant(name=req.hello.tenant), session=self.connections, slice_s=SLICE_S,
                                valid_s=VALID_S)))
                        continue
                    self.requests.put(req)

    def send(self, reply: pb.LeaseReply) -> None:
        assert self._conn is not None
        self._conn.sendall(frame(reply))

    def grant(self, lease: int, contended: bool = False, slice_left_s: float = SLICE_S) -> None:
        self.send(pb.LeaseReply(grant=pb.LeaseGrant(lease=lease, engine="compute", valid_s=VALID_S,
                                                    slice_left_s=slice_left_s, contended=contended)))

    def drop(self) -> None:
        """End the current connection (the daemon restarting)."""
        assert self._conn is not None
        self._conn.shutdown(socket.SHUT_RDWR)

    def next(self) -> pb.LeaseRequest:
        return self.requests.get(timeout=LIMIT_S)

    def nothing_sent(self) -> bool:
        return self.requests.empty()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


def kind(req: pb.LeaseRequest) -> str:
    name = req.WhichOneof("kind") or ""
    if name == "report":
        name += "".join(f" {f}" for f in ("release", "yielded") if getattr(req.report, f))
    return name


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Peer]:
    p = Peer(str(tmp_path / "lease.sock"))
    yield p
    p.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@contextlib.contextmanager
def client_of(peer: Peer, clock: FakeClock, **kwargs: float) -> Iterator[Client]:
    client = Client("t", socket=peer.path, clock=clock, **kwargs)  # type: ignore[arg-type]
    assert kind(peer.next()) == "hello"
    try:
        yield client
    finally:
        client.close()


def in_thread(fn: Callable[[], object], name: str = APP) -> tuple[threading.Thread, list[object]]:
    """Run `fn` in a thread named `name` (what the fake clock knows it by); its result or exception lands in the list."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, out


def granted(peer: Peer, clock: FakeClock, client: Client, **grant: float | bool) -> Gate:
    """A gate that wanted the engine and was granted lease 1; returns once the renew thread answered the grant
    (any reply wakes it: it renews at once) and is parked again."""
    gate = client.gate()
    assert not gate.acquire(timeout=0) and kind(peer.next()) == "want"
    renews = clock.sleeps(RENEW)
    peer.grant(1, **grant)  # type: ignore[arg-type]
    assert kind(peer.next()) == "report"  # the renewal the grant woke
    clock.await_sleep(RENEW, after=renews)
    assert gate.held
    return gate


def test_renewals_come_every_third_of_the_term_with_the_usage_measured_since(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock) as client:
        assert clock.await_sleep(RENEW) == pytest.approx(VALID_S / 3)
        gate = granted(peer, clock, client)
        assert gate.acquire(timeout=0)
        gate.done(0.02)
        renews = clock.sleeps(RENEW)
        clock.advance(VALID_S / 3 - EPS)
        assert clock.sleeps(RENEW) == renews and peer.nothing_sent()  # not due yet: the renew thread stays parked
        clock.advance(EPS)
        report = peer.next().report
        assert (round(report.gpu_seconds, 6), report.units, report.release) == (0.02, 1, False)
        assert clock.await_sleep(RENEW, after=renews) == pytest.approx(VALID_S / 3)


def test_a_contended_holder_reports_twice_a_slice(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock) as client:
        clock.await_sleep(RENEW)
        renews = clock.sleeps(RENEW)
        granted(peer, clock, client, contended=True)
        assert clock.await_sleep(RENEW, after=renews) == pytest.approx(min(SLICE_S / 2, VALID_S / 4))


def renew_round(peer: Peer, clock: FakeClock, seconds: float) -> pb.LeaseRequest:
    """Advance the clock with the renew thread parked; the request its round sent, once it is parked again."""
    parked = clock.sleeps(RENEW)
    clock.advance(seconds)
    req = peer.next()
    clock.await_sleep(RENEW, after=parked)
    return req


def test_an_unused_gate_is_released_after_four_slices_unless_a_unit_is_open(peer: Peer, clock: FakeClock) -> None:
    idle_s = max(4 * SLICE_S, VALID_S / 2)
    with client_of(peer, clock, renew_interval=idle_s / 2) as client:
        clock.await_sleep(RENEW)
        gate = granted(peer, clock, client)
        assert gate.acquire(timeout=0)  # a unit open (a first CUDA step can take long): held, renewed, not released
        assert kind(renew_round(peer, clock, idle_s + EPS)) == "report" and gate.wanting
        gate.done(0.01)
        assert kind(renew_round(peer, clock, idle_s / 2)) == "report" and gate.wanting  # used a round ago
        assert kind(renew_round(peer, clock, idle_s / 2 + EPS)) == "report release"
        assert not gate.wanting and not gate.held


def test_acquire_times_out_on_the_clock(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock, **QUIET) as client:
        gate = client.gate()
        t, out = in_thread(lambda: gate.acquire(timeout=0.5))
        assert clock.await_sleep(APP) == 0.5 and kind(peer.next()) == "want"
        clock.advance(0.25)
        assert t.is_alive() and clock.sleeps(APP) == 1  # still parked: half the timeout passed
        clock.advance(0.25)
        t.join(LIMIT_S)
        assert out == [False]


def test_a_grant_ends_the_wait_in_acquire(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock) as client:
        gate = client.gate()
        t, out = in_thread(gate.acquire)
        assert clock.await_sleep(APP) is None and kind(peer.next()) == "want"
        peer.grant(1)
        t.join(LIMIT_S)
        assert out == [True] and gate.open_units == 1


def test_no_unit_starts_after_a_contended_slice_and_its_grace_end_and_the_slice_is_charged(peer: Peer,
                                                                                           clock: FakeClock) -> None:
    with client_of(peer, clock, **QUIET) as client:
        gate = granted(peer, clock, client, contended=True)
        assert gate.acquire(timeout=0)
        gate.done(0.01)
        clock.advance(SLICE_S - EPS)
        assert gate.acquire(timeout=0)  # inside the slice
        gate.done(0.01)
        clock.advance(START_GRACE_S - EPS)
        assert gate.acquire(timeout=0)  # the slice is over, but the daemon's renewal is on its way
        gate.done(0.01)
        assert peer.nothing_sent()
        clock.advance(2 * EPS)
        assert not gate.acquire(timeout=0)  # the grace is over too: wait for the daemon's renewal
        report = peer.next().report  # and it learns the slice's charge first, and when that work ended
        assert (round(report.gpu_seconds, 6), report.units) == (0.03, 3)
        assert report.ended_ago_s == pytest.approx(2 * EPS)


def test_a_report_without_gpu_time_says_no_end(peer: Peer, clock: FakeClock) -> None:
    """`ended_ago_s` 0 means "not known" on the wire: a report with no work places none."""
    with client_of(peer, clock, **QUIET) as client:
        gate = granted(peer, clock, client, contended=True)
        assert gate.acquire(timeout=0)
        gate.done(0.0)
        clock.advance(EPS)
        gate.release()
        report = peer.next().report
        assert (report.gpu_seconds, report.release, report.ended_ago_s) == (0.0, True, 0.0)


def test_reconnect_backs_off_doubling_to_its_cap_and_wants_again(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock, **QUIET) as client:
        gate = client.gate()
        assert not gate.acquire(timeout=0) and kind(peer.next()) == "want"
        peer.mute = True
        parked = clock.sleeps(STREAM)
        peer.drop()
        waits: list[float] = []
        for _ in range(8):
            wait = clock.await_sleep(STREAM, after=parked)
            assert wait is not None
            waits.append(wait)
            parked, connections = clock.sleeps(STREAM), peer.connections
            clock.advance(waits[-1] - EPS)
            assert peer.connections == connections and clock.sleeps(STREAM) == parked  # the back-off is not over
            assert not client.governed
            clock.advance(2 * EPS)
            assert kind(peer.next()) == "hello"  # connected again (and the peer hung up at once)
        assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])  # then 2.0 again
        peer.mute = False
        assert clock.await_sleep(STREAM, after=parked) == pytest.approx(2.0)
        parked = clock.sleeps(STREAM)
        clock.advance(2.0 + EPS)
        assert kind(peer.next()) == "hello" and kind(peer.next()) == "want"  # the gate still wants the engine
        peer.drop()  # registered again (the welcome comes before the end): the back-off starts over
        assert clock.await_sleep(STREAM, after=parked) == pytest.approx(0.05)
        assert client.connects == 2


def test_a_request_without_an_ack_times_out_on_the_clock(peer: Peer, clock: FakeClock) -> None:
    with client_of(peer, clock, **QUIET) as client:
        t, out = in_thread(lambda: client.renew(timeout=1.0))
        assert clock.await_sleep(APP) == 1.0 and kind(peer.next()) == "report"
        clock.advance(1.0)
        t.join(LIMIT_S)
        assert len(out) == 1 and isinstance(out[0], UnischedError)
        assert str(out[0]) == "no answer from the daemon within 1 s"


def test_registration_waits_for_a_connected_daemon_on_the_clock(peer: Peer, clock: FakeClock) -> None:
    peer.silent = True
    t, out = in_thread(lambda: Client("t", socket=peer.path, clock=clock, connect_timeout=5, register_timeout=60))
    assert clock.await_sleep(APP) == 5 and kind(peer.next()) == "hello"
    clock.advance(5)
    assert clock.await_sleep(APP, after=1) == 60  # connected: waits on, past the connect timeout
    clock.advance(60)
    t.join(LIMIT_S)
    assert len(out) == 1 and isinstance(out[0], UnischedUnavailable)
    assert "connected, but no answer to the registration within 65 s" in str(out[0])


def test_the_clock_defaults_to_the_system_clock(peer: Peer) -> None:
    client = Client("t", socket=peer.path, connect_timeout=LIMIT_S)
    try:
        assert isinstance(client.clock, SystemClock) and client.governed
    finally:
        client.close()


# --- the turn rule alone ------------------------------------------------------------------------------------

def gate_with(lease: int = 0, contended: bool = False, slice_end: float = 0.0, jump: bool = False,
              busy_until: float = 0.0) -> Gate:
    g = Gate(cast(Client, None), "compute")
    g.lease, g.contended, g.slice_end, g.jump, g.busy_until = lease, contended, slice_end, jump, busy_until
    return g


@pytest.mark.parametrize(("gate", "governed", "now", "fresh_want", "expected"), [
    (gate_with(), False, 0.0, False, Start.UNGOVERNED),
    (gate_with(), True, 0.0, False, Start.WAIT),
    (gate_with(lease=1), True, 5.0, False, Start.HELD),  # alone: the slice's end does not matter
    (gate_with(lease=1, contended=True, slice_end=5.0), True, 4.9, False, Start.HELD),
    (gate_with(lease=1, contended=True, slice_end=5.0), True, 5.0, False, Start.HELD),  # in the grace
    (gate_with(lease=1, contended=True, slice_end=5.0), True, 5.0 + START_GRACE_S, False, Start.WAIT),
    # queued behind a unit that ends at busy_until: it starts on the GPU then
    (gate_with(lease=1, contended=True, slice_end=5.0, busy_until=5.0), True, 4.9, False, Start.HELD),
    (gate_with(lease=1, contended=True, slice_end=5.0, busy_until=5.0 + START_GRACE_S), True, 4.9, False, Start.WAIT),
    (gate_with(lease=1, slice_end=5.0, busy_until=9.0), True, 4.9, False, Start.HELD),  # alone: it does not matter
    (gate_with(jump=True), True, 0.0, True, Start.JUMP),
    (gate_with(jump=True), True, 0.0, False, Start.WAIT),  # jumps only with the want it just sent
    (gate_with(jump=True), False, 0.0, True, Start.UNGOVERNED),
    (gate_with(lease=1, jump=True, contended=True, slice_end=5.0), True, 0.0, True, Start.HELD),  # held: no jump spent
])
def test_may_start(gate: Gate, governed: bool, now: float, fresh_want: bool, expected: Start) -> None:
    assert may_start(gate, governed, now, fresh_want) is expected
