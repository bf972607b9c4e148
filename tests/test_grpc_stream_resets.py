"""A gRPC connection's streams are let go of however their calls end: answered, reset by the client in the same
read that opened them, or refused for their declared size. grpclib releases a stream in its call's `finally`,
which a call cancelled before its first step never reaches; without the door's own release each such stream
stayed held for the connection's life (about 8 KiB each, and the connection never idled out)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events

from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import GrpcDoor
from unisched.transport.h2guard import RESETS_PER_WINDOW
from unisched.transport.identity import PeerCred
from unisched_wire import unisched_pb2 as pb

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", "/unisched.v1.Unisched/Status"),
           (":authority", "unisched"), ("content-type", "application/grpc"), ("te", "trailers")]
ABUSED = 300
"""Streams the client opens and has refused for their size (resets are bounded by RESETS_PER_WINDOW: it resets
that many, all the door lets one connection reset at once)."""


class Answering:
    def __getattr__(self, name: str) -> Any:
        async def method(request: Any, call: Any) -> Any:
            return pb.StatusReply()
        return method


async def _session() -> tuple[int, int, int]:
    """Streams reset as they open, streams refused for size, then one real call on the same connection; returns
    the calls and streams the daemon's side still holds once that call is answered, and the answers seen."""
    loop = asyncio.get_running_loop()
    door = GrpcDoor(Answering(), "unisched.sock")
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True, calls=4)
    served = asyncio.ensure_future(door.serve(ours, PeerCred(1, 65534, 65534), limits))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    await loop.sock_sendall(theirs, client.data_to_send())
    for _ in range(RESETS_PER_WINDOW):  # HEADERS and RST_STREAM in one write: the call is cancelled before it starts
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, HEADERS, end_stream=True)
        client.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        await loop.sock_sendall(theirs, client.data_to_send())
    for _ in range(ABUSED):  # a message that declares 1 MiB: refused
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, HEADERS)
        client.send_data(sid, b"\0" + (1 << 20).to_bytes(4, "big"), end_stream=True)
        await loop.sock_sendall(theirs, client.data_to_send())
        await _read_until(loop, theirs, client, _ended(sid))
    sid = client.get_next_available_stream_id()
    body = pb.StatusRequest().SerializeToString()
    client.send_headers(sid, HEADERS)
    client.send_data(sid, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    await loop.sock_sendall(theirs, client.data_to_send())
    answered = await _read_until(loop, theirs, client, _ended(sid))
    for _ in range(10):  # the done callbacks of tasks that ended in the last steps
        await asyncio.sleep(0)
    (conn,) = door._open
    held = len(conn._requests), len(conn.processor.streams)
    theirs.close()
    await door.close()
    await asyncio.gather(served, return_exceptions=True)
    return held[0], held[1], answered


def _ended(sid: int) -> Any:
    return lambda e: isinstance(e, h2.events.StreamEnded) and e.stream_id == sid


async def _read_until(loop: asyncio.AbstractEventLoop, sock: socket.socket, client: h2.connection.H2Connection,
                      done: Any) -> int:
    ended = 0
    while True:
        data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30)
        assert data, "the daemon closed the connection"
        events = client.receive_data(data)
        await loop.sock_sendall(sock, client.data_to_send())
        ended += sum(isinstance(e, h2.events.StreamEnded) for e in events)
        if any(done(e) for e in events):
            return ended


def test_streams_reset_as_they_open_or_refused_for_size_are_not_held() -> None:
    requests, streams, answered = asyncio.run(_session())
    assert answered >= 1  # the connection still serves real calls
    assert (requests, streams) == (0, 0)
