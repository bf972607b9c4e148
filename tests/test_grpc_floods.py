"""A gRPC connection's frames cannot hold the event loop: h2 gets at most FEED_PER_TURN bytes of a read per loop
turn, and a connection that resets streams as fast as it opens them (rapid reset) or floods control frames (PING)
is dropped after a bounded number. Before, one read of such frames (~200 KB) was handled whole in one callback:
6,000 HEADERS+RST_STREAM pairs held the loop 7.5 s, a read of PINGs ~400 ms."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any

import grpclib.protocol
import hpack
import pytest

from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import PREFACE, GrpcDoor
from unisched.transport.h2guard import CONTROL_PER_WINDOW, FEED_PER_TURN, RESETS_PER_WINDOW
from unisched.transport.identity import PeerCred
from unisched_wire import unisched_pb2 as pb

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/unisched.v1.Unisched/Status"),
           (":authority", "unisched"), ("content-type", "application/grpc"), ("te", "trailers")]


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", sid) + payload


def rapid_resets(count: int) -> bytes:
    """HEADERS (END_STREAM, END_HEADERS) then RST_STREAM(CANCEL) on streams 1, 3, 5, ...: one write."""
    enc = hpack.Encoder()
    return b"".join(_frame(1, 5, sid, enc.encode(HEADERS)) + _frame(3, 0, sid, struct.pack(">I", 8))
                    for sid in range(1, 2 * count, 2))


def pings(count: int) -> bytes:
    return _frame(6, 0, 0, b"12345678") * count


class Answering:
    def __getattr__(self, name: str) -> Any:
        async def method(request: Any, call: Any) -> Any:
            return pb.StatusReply()
        return method


class Fed:
    """Records each slice the door gives h2, with the loop turn it was given in."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.slices: list[tuple[int, int]] = []
        self.turn = 0
        self.accepted = 0
        feed = grpclib.protocol.Connection.feed
        process = grpclib.protocol.EventsProcessor.process_request_received

        def counting_feed(conn: Any, data: bytes) -> Any:
            self.slices.append((len(data), self.turn))
            return feed(conn, data)

        def counting_accept(proc: Any, event: Any) -> None:
            self.accepted += 1
            process(proc, event)
        monkeypatch.setattr(grpclib.protocol.Connection, "feed", counting_feed)
        monkeypatch.setattr(grpclib.protocol.EventsProcessor, "process_request_received", counting_accept)

    def total(self) -> int:
        return sum(n for n, _ in self.slices)

    async def ticking(self) -> None:
        while True:
            self.turn += 1
            await asyncio.sleep(0)


async def _flood(blob: bytes, fed: Fed, clock: Callable[[], float], read: bool) -> bool:
    """Serve one connection on a socketpair and send the preface, SETTINGS and `blob` in one write; returns
    whether the daemon ended the connection (False: it served the whole blob and kept it)."""
    loop = asyncio.get_running_loop()
    door = GrpcDoor(Answering(), "unisched.sock")
    door.clock = clock
    ours, theirs = socket.socketpair()
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    ours.setblocking(False)
    theirs.setblocking(False)
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True, calls=4)
    ticker = asyncio.ensure_future(fed.ticking())
    served = asyncio.ensure_future(door.serve(ours, PeerCred(1, 65534, 65534), limits))
    received = 0

    async def drain() -> None:
        nonlocal received
        with contextlib.suppress(OSError):
            while received < len(blob) and (data := await loop.sock_recv(theirs, 1 << 16)):
                received += len(data)  # the daemon answers every PING: the whole blob was handled once as much came back
    reader = asyncio.ensure_future(drain()) if read else None
    with contextlib.suppress(OSError):
        await loop.sock_sendall(theirs, PREFACE + _frame(4, 0, 0, b"") + blob)
    try:
        if reader is None:  # until the daemon ends it, or has parsed all of it and kept it open
            sent = len(PREFACE) + 9 + len(blob)
            while not served.done() and fed.total() < sent:
                await asyncio.wait([served], timeout=0.01)
            await asyncio.wait([served], timeout=1.0)  # (only a connection kept open waits this out)
        else:
            await asyncio.wait([served, reader], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        ended = served.done()
    finally:
        theirs.close()
        ticker.cancel()
        await door.close()
        await asyncio.gather(served, ticker, *([reader] if reader else []), return_exceptions=True)
    return ended


def test_rapid_reset_connection_is_dropped_after_a_bounded_number_of_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    fed = Fed(monkeypatch)
    ended = asyncio.run(_flood(rapid_resets(3000), fed, lambda: 0.0, read=False))
    assert ended
    assert fed.accepted <= RESETS_PER_WINDOW + 1  # a grpclib task each: before, all 3,000
    assert sum(n for n, _ in fed.slices) <= 2 * FEED_PER_TURN  # the rest of the burst was never parsed


def test_ping_flood_connection_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    fed = Fed(monkeypatch)
    ended = asyncio.run(_flood(pings(10_000), fed, lambda: 0.0, read=False))
    assert ended
    assert CONTROL_PER_WINDOW * 17 < FEED_PER_TURN  # (the bound is reached within the first slice)
    assert sum(n for n, _ in fed.slices) <= 2 * FEED_PER_TURN


def test_a_large_read_is_handled_a_slice_per_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """PINGs within the bound (each window fresh): one ~150 KB read is given to h2 in slices, the loop's other
    work running between them."""
    fed = Fed(monkeypatch)
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]
    ended = asyncio.run(_flood(pings(9_000), fed, clock, read=True))
    assert not ended
    sizes = [n for n, _ in fed.slices]
    turns = [t for _, t in fed.slices]
    assert sum(sizes) >= 9_000 * 17  # all of it was handled
    assert max(sizes) <= FEED_PER_TURN
    assert len(set(turns)) == len(turns)  # no two slices in the same turn of the loop


async def _unread_pings(total: int) -> tuple[int, int, bool, bool]:
    """A client that sends PINGs (within the budget: each window fresh) and never reads what the daemon answers,
    sending until the daemon stops taking them; returns bytes it got sent, the most the daemon held unsent,
    whether the daemon still reads it, and whether the connection was dropped."""
    door = GrpcDoor(Answering(), "unisched.sock")
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]
    door.clock = clock
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True, calls=4)
    served = asyncio.ensure_future(door.serve(ours, PeerCred(1, 65534, 65534), limits))
    blob = PREFACE + _frame(4, 0, 0, b"") + pings(total // 17)
    sent = most = stuck = 0
    reading = True
    try:
        while sent < len(blob) and stuck < 200 and not served.done():  # stuck: turns with nothing taken
            try:
                sent += theirs.send(blob[sent:sent + (1 << 16)])
                stuck = 0
            except BlockingIOError:
                stuck += 1
            await asyncio.sleep(0)
            for conn in door._open:
                t = conn._transport
                assert isinstance(t, asyncio.Transport)
                most = max(most, t.get_write_buffer_size())
                reading = t.is_reading()
        return sent, most, reading, served.done()
    finally:
        theirs.close()
        await door.close()
        await asyncio.gather(served, return_exceptions=True)


def test_a_client_that_does_not_read_is_not_read_from() -> None:
    """Before, the daemon kept reading and acknowledging: what it held unsent grew with what the client sent (up
    to the 8 MiB cap per connection, 1 GiB for one uid's 128)."""
    sent, most, reading, dropped = asyncio.run(_unread_pings(4 << 20))
    assert not dropped
    assert not reading
    assert sent < 2 << 20  # the kernel's buffers and a read: the client could not send it all
    assert most <= 64 * 1024 + 2 * FEED_PER_TURN  # the transport's high-water mark and one slice's acks


def test_the_control_frames_a_connection_may_send_grow_with_the_calls_it_makes() -> None:
    """A client making calls back to back sends a few control frames each (flow control, bandwidth-probing PINGs):
    its calls earn it room; the same frames without calls are a flood."""
    from h2.events import PingReceived, RequestReceived

    from unisched.transport.h2guard import CONTROL_PER_CALL, FrameBudget

    busy = FrameBudget(clock=lambda: 0.0)
    for _ in range(200):
        assert busy.over(RequestReceived(stream_id=1)) is None
        for _ in range(CONTROL_PER_CALL):
            assert busy.over(PingReceived(ping_data=b"12345678")) is None
    assert busy.control == 200 * CONTROL_PER_CALL > CONTROL_PER_WINDOW
    idle = FrameBudget(clock=lambda: 0.0)
    verdicts = [idle.over(PingReceived(ping_data=b"12345678")) for _ in range(CONTROL_PER_WINDOW + 1)]
    assert verdicts[:-1] == [None] * CONTROL_PER_WINDOW and verdicts[-1] is not None


def test_a_call_reset_after_the_slice_that_opened_it_is_no_rapid_reset() -> None:
    """A client with short deadlines against a slow daemon cancels many calls, each after it was open for a turn of
    the loop (the calls-in-flight limit bounds those): only a stream reset in the same slice of bytes that opened it
    counts towards RESETS_PER_WINDOW."""
    from h2.events import StreamReset

    from unisched.transport.h2guard import FrameBudget

    def reset(sid: int) -> StreamReset:
        return StreamReset(stream_id=sid, remote_reset=True)

    late = FrameBudget(clock=lambda: 0.0)
    assert all(late.over(reset(sid), opened=()) is None for sid in range(1, 2 * 500, 2))
    rapid = FrameBudget(clock=lambda: 0.0)
    verdicts = [rapid.over(reset(sid), opened={sid}) for sid in range(1, 2 * (RESETS_PER_WINDOW + 1), 2)]
    assert verdicts[:-1] == [None] * RESETS_PER_WINDOW and verdicts[-1] is not None
