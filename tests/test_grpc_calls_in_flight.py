"""A non-admin connection's gRPC calls in flight are bounded from its first SETTINGS frame
(options.GRPC_CALLS_PER_CONNECTION): each call's handler starts on the daemon's loop as its request arrives, so
h2's default of 100 a connection let one uid start 12,800 at once. A gRPC client queues its extra calls itself; a
peer that opens more streams than allowed is dropped before any of them starts. The daemon's GrpcDoor on a real
Unix socket, grpcio and raw h2 as clients."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.settings

from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import GrpcDoor
from unisched.transport.identity import PeerCred
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc

CALLS = 2
"""The connection's calls in flight in these tests."""


class Counting:
    """Every method counts the calls in flight at once, and yields to the loop before answering."""

    def __init__(self) -> None:
        self.now = self.most = self.started = 0

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        async def method(request: Any, call: Any) -> Any:
            self.started += 1
            self.now += 1
            self.most = max(self.most, self.now)
            for _ in range(5):
                await asyncio.sleep(0)
            self.now -= 1
            return pb.StatusReply()
        return method


async def serve_unix(path: str, door: GrpcDoor, listening: threading.Event, stop: asyncio.Event) -> None:
    """Accept on `path` and serve each connection as a non-admin one held to CALLS calls in flight."""
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)
    listening.set()
    limits = StreamLimits(hello_s=5.0, partial_frame_s=5.0, hold=lambda delta: True, calls=CALLS)
    served: list[asyncio.Future[None]] = []

    async def accept() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            served.append(asyncio.ensure_future(door.serve(conn, PeerCred(1, 65534, 65534), limits)))

    acceptor = asyncio.ensure_future(accept())
    await stop.wait()
    acceptor.cancel()
    listener.close()
    await door.close()
    await asyncio.gather(*served, return_exceptions=True)


def run_door(path: str, servicer: Counting, client: Callable[[], Any]) -> Any:
    """The door served on a loop of its own while `client` runs on this thread; returns what it returned."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    listening = threading.Event()

    def main() -> None:
        async def go() -> None:
            await serve_unix(path, GrpcDoor(servicer, "lease.sock"), listening, stop)
        loop.run_until_complete(go())

    t = threading.Thread(target=main)
    t.start()
    assert listening.wait(10)
    try:
        return client()
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(30)
        loop.close()


def test_a_grpc_client_queues_its_calls_past_the_limit_and_every_call_is_answered(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    servicer = Counting()

    def client() -> list[Any]:
        with grpc.insecure_channel(f"unix:{path}") as ch:
            grpc.channel_ready_future(ch).result(timeout=10)
            stub = pb_grpc.UnischedStub(ch)
            futures = [stub.Status.future(pb.StatusRequest(), timeout=30) for _ in range(40)]
            return [f.result() for f in futures]

    replies = run_door(path, servicer, client)
    assert len(replies) == 40 and servicer.started == 40
    assert servicer.most <= CALLS


def raw_calls(n: int) -> bytes:
    """An HTTP/2 client's preface and `n` Status calls sent before it reads the server's SETTINGS."""
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    body = pb.StatusRequest().SerializeToString()
    for _ in range(n):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/unisched.v1.Unisched/Status"),
                             (":authority", "unisched"), ("content-type", "application/grpc"), ("te", "trailers")])
        c.send_data(sid, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    return c.data_to_send()


def test_a_peer_that_opens_more_streams_than_allowed_at_once_is_dropped_before_any_starts(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    servicer = Counting()

    def client() -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.settimeout(10)
            s.sendall(raw_calls(CALLS + 3))  # its first flight, before any SETTINGS of the daemon's was read
            got = b""
            while chunk := s.recv(1 << 16):  # until the daemon closes it
                got += chunk
            return got

    client_saw = run_door(path, servicer, client)
    assert servicer.started == 0
    settings = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    settings.initiate_connection()
    events = settings.receive_data(client_saw)
    changed = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
    assert changed and changed[0].changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS].new_value == CALLS
