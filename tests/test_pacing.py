"""transport.pacing: registrations take about one event-loop turn each, in order, so a burst of them cannot hold
the loop (and every tenant's lease renewals) for seconds. The turns here are driven by hand; the lease stream's
use of it against a real loop and real sockets is the last test."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from inproc import InProcessServer, in_process_server

from unisched.transport.pacing import Pacer
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
        p.queue(registrar(log, name))
    assert not p.take()  # nobody jumps the queue, even in a turn of its own
    seen = []
    for _ in range(4):
        loop.turn()
        seen.append("".join(log))
    assert seen == ["a", "ab", "abc", "abc"]
    loop.turn()
    assert p.take() and p.waiting == 0


def test_a_caller_gone_while_it_waited_leaves_its_turn_to_the_next() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    assert p.take()
    p.queue(registrar(log, "gone", alive=False))
    p.queue(registrar(log, "b"))
    loop.turn()
    assert log == ["b"]


def test_a_registration_that_raises_does_not_stop_the_queue() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)

    def boom() -> bool:
        raise RuntimeError("boom")

    assert p.take()
    p.queue(boom)
    p.queue(registrar(log, "b"))
    with pytest.raises(RuntimeError):
        loop.turn()
    loop.turn()
    assert log == ["b"]


def test_a_queue_with_no_turn_taken_still_starts() -> None:
    loop, log = Loop(), list[str]()
    p = Pacer(loop.call_soon)
    p.queue(registrar(log, "a"))
    loop.turn()
    assert log == ["a"]


def test_awaiting_callers_register_one_turn_apart() -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        p = Pacer(loop.call_soon)
        turns = [0]

        def count() -> None:  # runs once per turn of the loop
            turns[0] += 1
            loop.call_soon(count)

        loop.call_soon(count)
        at: list[int] = []

        async def register() -> None:
            await p.turn()
            at.append(turns[0])

        tasks = [asyncio.ensure_future(register()) for _ in range(5)]
        await asyncio.sleep(0)
        tasks[2].cancel()  # gone while it waited
        await asyncio.gather(*tasks, return_exceptions=True)
        return at

    at = asyncio.run(main())
    assert len(at) == 4
    assert all(b > a for a, b in itertools.pairwise(at)), at


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
    turn = [0]

    def count() -> None:
        turn[0] += 1
        loop.call_soon(count)

    loop.call_soon_threadsafe(count)
    opened_in: list[int] = []
    lease_open = server.engine.lease_open

    def counted_open(*args: object, **kwargs: object) -> object:
        opened_in.append(turn[0])
        return lease_open(*args, **kwargs)  # type: ignore[arg-type]

    server.engine.lease_open = counted_open  # type: ignore[method-assign]
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
