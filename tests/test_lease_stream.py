"""The lease stream on the daemon's Unix socket (not gRPC): identity from SO_PEERCRED, bounded messages and
buffers, clear errors, and no second lease path through gRPC. The client library's use of it is in test_client."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import wait_until
from inproc import InProcessServer, in_process_server

from unisched.transport import lease
from unisched.transport import unisched_pb2 as pb
from unisched.transport.client import DaemonClient
from unisched.transport.leasewire import MAGIC, MAX_REPLY_BYTES, MAX_REQUEST_BYTES, FrameReader, frame


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state") as s:
        yield s


@contextlib.contextmanager
def lease_socket(server: InProcessServer, rcvbuf: int | None = None) -> Iterator[socket.socket]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(server.socket)
    with s:
        yield s


def replies_until_closed(s: socket.socket) -> list[pb.LeaseReply]:
    reader, out = FrameReader(MAX_REPLY_BYTES), []
    while data := s.recv(1 << 16):
        out += [pb.LeaseReply.FromString(p) for p in reader.feed(data)]
    return out


def hello(tenant: str) -> bytes:
    return MAGIC + frame(pb.LeaseRequest(hello=pb.LeaseHello(tenant=tenant)))


def test_a_lease_stream_acts_for_the_connecting_process_only(server: InProcessServer) -> None:
    with lease_socket(server) as s:
        s.sendall(hello("coop") + frame(pb.LeaseRequest(seq=7, want=pb.LeaseWant(engine="compute"))))
        s.shutdown(socket.SHUT_WR)
        replies = replies_until_closed(s)
    kinds = [r.WhichOneof("kind") for r in replies]
    assert kinds[:2] == ["welcome", "ack"] and replies[1].seq == 7, kinds  # the reply first, then the grant
    assert "grant" in kinds
    assert replies[0].welcome.tenant.name == "coop"
    assert server.driver.pids("/unisched/coop") == [os.getpid()]  # the SO_PEERCRED pid: no field names one
    wait_until(lambda: not next(t for t in server.engine.snapshots() if t.name == "coop").cooperative, 10,
               "the session to end with its connection")


def test_grpc_has_no_lease_call(server: InProcessServer) -> None:
    """One lease transport: the gRPC API lost its Lease stream when the lease stream moved to its own framing."""
    with DaemonClient(server.socket) as c:
        assert c.status().caller_pid == os.getpid()  # gRPC on the same socket still works
    with grpc.insecure_channel(f"unix:{server.socket}") as ch:
        call = ch.stream_stream("/unisched.v1.Unisched/Lease", request_serializer=pb.LeaseRequest.SerializeToString,
                                response_deserializer=pb.LeaseReply.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(iter([pb.LeaseRequest(hello=pb.LeaseHello(tenant="side"))]), timeout=10))
    assert e.value.code() is grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize(("payload", "code"), [
    ((MAX_REQUEST_BYTES + 1).to_bytes(4, "big"), "RESOURCE_EXHAUSTED"),  # refused before it is read
    (frame(pb.LeaseWant(engine="x" * 100)), "INVALID_ARGUMENT"),  # not a LeaseRequest: field 1 is a hello
    (b"\x00\x00\x00\x03\xff\xff\xff", "INVALID_ARGUMENT"),
    (frame(pb.LeaseRequest(report=pb.LeaseReport(engine="compute"))), "INVALID_ARGUMENT"),  # before hello
])
def test_bad_frames_get_an_error_and_the_end_of_the_stream(server: InProcessServer, payload: bytes, code: str) -> None:
    with lease_socket(server) as s:
        s.sendall(MAGIC + payload)
        replies = replies_until_closed(s)
    assert [r.error.code for r in replies] == [code], replies
    assert len(replies[0].error.details) < 1024
    with DaemonClient(server.socket) as c:
        assert c.status().caller_pid == os.getpid()  # still serving


def test_a_request_at_the_size_limit_is_read(server: InProcessServer) -> None:
    big, n = pb.LeaseRequest(), MAX_REQUEST_BYTES
    while big.hello.tenant != "t" * n or big.ByteSize() > MAX_REQUEST_BYTES:
        n -= 1
        big.hello.tenant = "t" * n
    assert big.ByteSize() == MAX_REQUEST_BYTES
    with lease_socket(server) as s:
        s.sendall(MAGIC + frame(big))
        replies = replies_until_closed(s)
    assert [r.error.code for r in replies] == ["INVALID_ARGUMENT"]  # read, and refused for its tenant name
    assert "tenant name" in replies[0].error.details


def test_a_client_that_never_reads_is_dropped(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acks it does not read pile up in the daemon only up to LEASE_UNSENT_MAX; then its session ends."""
    monkeypatch.setattr(lease, "LEASE_UNSENT_MAX", 8192)
    renewal = frame(pb.LeaseRequest(seq=1, report=pb.LeaseReport(engine="compute")))
    with lease_socket(server, rcvbuf=4096) as s:
        s.sendall(hello("mute") + frame(pb.LeaseRequest(want=pb.LeaseWant(engine="compute"))))
        wait_until(lambda: any(t.name == "mute" and t.cooperative for t in server.engine.snapshots()), 10,
                   "the session to open")
        with contextlib.suppress(OSError):  # EPIPE / ECONNRESET once dropped
            for _ in range(100):  # up to ~2.5 MB of acks, far more than the socket buffers hold
                s.sendall(renewal * 1000)
        wait_until(lambda: not next(t for t in server.engine.snapshots() if t.name == "mute").cooperative, 10,
                   "the session to be dropped")
