"""A non-admin connection's gRPC calls in flight are bounded from its first SETTINGS frame
(options.GRPC_CALLS_PER_CONNECTION): each call's handler starts on the daemon's loop as its request arrives, so
h2's default of 100 a connection let one uid start 12,800 at once. A gRPC client queues its extra calls itself; a
peer that opens more streams than allowed is dropped before any of them starts. The daemon's GrpcDoor on a real
Unix socket, grpcio and raw h2 as clients."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.settings
import pytest
from conftest import Daemon, child_env

from unisched.transport.frontdoor import StreamLimits
from unisched.transport.grpcdoor import GrpcDoor
from unisched.transport.identity import PeerCred
from unisched.transport.options import GRPC_CALLS_PER_CONNECTION
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


def raw_calls(n: int) -> tuple[h2.connection.H2Connection, bytes]:
    """An HTTP/2 client, and its preface and `n` Status calls sent before it reads the server's SETTINGS."""
    c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    c.initiate_connection()
    body = pb.StatusRequest().SerializeToString()
    for _ in range(n):
        sid = c.get_next_available_stream_id()
        c.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", "/unisched.v1.Unisched/Status"),
                             (":authority", "unisched"), ("content-type", "application/grpc"), ("te", "trailers")])
        c.send_data(sid, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
    return c, c.data_to_send()


def test_a_peer_that_opens_more_streams_than_allowed_at_once_is_dropped_before_any_starts(tmp_path: Path) -> None:
    path = str(tmp_path / "d.sock")
    servicer = Counting()

    def client() -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.settimeout(10)
            s.sendall(raw_calls(CALLS + 3)[1])  # its first flight, before any SETTINGS of the daemon's was read
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


def test_a_peer_that_pings_without_end_and_never_reads_is_dropped_at_the_unsent_bound(tmp_path: Path) -> None:
    """h2 acknowledges each PING at once, whatever the client reads: without a bound on what waits unsent, such a
    client would grow the daemon by what it sends."""
    from unisched.transport.grpcdoor import UNSENT_MAX

    path = str(tmp_path / "d.sock")
    ping = len(b"12345678").to_bytes(3, "big") + bytes([6, 0]) + bytes(4) + b"12345678"
    settings = bytes(3) + bytes([4, 0]) + bytes(4)

    def client() -> int:
        with socket.socket(socket.AF_UNIX) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(path)
            s.settimeout(30)
            s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings)
            sent, blob = 0, ping * 4096
            try:
                while sent < 16 * UNSENT_MAX:
                    s.sendall(blob)
                    sent += len(blob)
            except (BrokenPipeError, ConnectionResetError):
                return sent
            return -1

    sent = run_door(path, Counting(), client)
    assert 0 < sent < 16 * UNSENT_MAX  # dropped once the acknowledgements it left unread passed the bound


# --- the real daemon: the limit is a non-admin connection's, an admin keeps h2's 100 ---------------------------

PEER = r"""
import os, socket, sys
import h2.events
path, n, uid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from test_grpc_calls_in_flight import raw_calls
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
c, first = raw_calls(n)
ended = 0
with socket.socket(socket.AF_UNIX) as s:
    s.connect(path)
    s.settimeout(20)
    s.sendall(first)
    try:
        while ended < n and (data := s.recv(1 << 16)):
            for e in c.receive_data(data):
                ended += isinstance(e, h2.events.StreamEnded)
            s.sendall(c.data_to_send())
    except (ConnectionResetError, BrokenPipeError):  # dropped with our requests unread (reset, or gone when we write)
        pass
print(ended)
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_the_daemon_holds_a_non_admin_connection_to_the_limit_and_an_admins_to_h2s(daemon: Daemon) -> None:
    os.chmod(Path(daemon.socket).parent, 0o755)  # nobody reaches the socket
    n = GRPC_CALLS_PER_CONNECTION + 1

    def answered(uid: int) -> int:
        out = subprocess.run([sys.executable, "-c", PEER, daemon.socket, str(n), str(uid), str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=60, env=child_env())
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout)

    assert answered(0) == n  # root: an admin
    assert answered(65534) == 0  # dropped before any call started
