"""The lease stream on the daemon's Unix socket (not gRPC): identity from SO_PEERCRED, bounded messages and
buffers, clear errors, and no second lease path through gRPC. The client library's use of it is in test_client."""

from __future__ import annotations

import contextlib
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inproc import InProcessServer, in_process_server

from unisched.policy import WEIGHT_MAX, WEIGHT_MIN, validate_tenant_name
from unisched.transport import lease
from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, MAX_REQUEST_BYTES, FrameError, FrameReader, frame


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
    s.connect(server.lease_socket)
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
        assert c.status().caller_pid == os.getpid()  # gRPC on its socket works
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


# --- fuzz: hypothesis-generated lease streams (the gRPC API's fuzz is test_fuzz_grpc.py) ---------------------
LEASE_ERRORS = {"INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
_NAMES = st.one_of(st.sampled_from(["fz", "fz2", "x" * 63, "x" * 64, "", "..", "a/b", "ünï", "a\x00b"]),
                   st.text(max_size=70))
_ENGINES = st.one_of(st.sampled_from(["compute", "graphics", "decode", "encode", "", "warp"]), st.text(max_size=10))
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0.0, -1.0, 1e-9, 0.05, 1e9, float("nan"), float("inf")]))
_REQUESTS = st.one_of(
    st.builds(lambda t, w, p, e, g, s: pb.LeaseRequest(seq=s, hello=pb.LeaseHello(
        tenant=t, weight=w, priority=p, engines=e, gpu=g)),
        _NAMES, st.integers(-(2**31), 2**31 - 1), st.integers(-3, 5), st.lists(_ENGINES, max_size=4),
        st.integers(-(2**31), 2**31 - 1), st.integers(0, 2**64 - 1)),
    st.builds(lambda e, s: pb.LeaseRequest(seq=s, want=pb.LeaseWant(engine=e)), _ENGINES, st.integers(0, 2**64 - 1)),
    st.builds(lambda e, g, r, y, s, a: pb.LeaseRequest(seq=s, report=pb.LeaseReport(
        engine=e, gpu_seconds=g, release=r, yielded=y, ended_ago_s=a)), _ENGINES, _FLOATS, st.booleans(),
        st.booleans(), st.integers(0, 2**64 - 1), _FLOATS),
    st.builds(lambda k, o, s: pb.LeaseRequest(seq=s, session=pb.CodecSession(kind=k, open=o)),
              st.one_of(st.sampled_from(["nvdec", "nvenc", "graphics", ""]), st.text(max_size=8)), st.booleans(),
              st.integers(0, 2**64 - 1)),
)
_FRAMES = st.lists(st.one_of(_REQUESTS.map(frame), st.binary(max_size=40)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=_FRAMES, with_magic=st.booleans())
def test_fuzzed_lease_streams_leave_the_daemon_serving_and_consistent(
    server: InProcessServer, frames: list[bytes], with_magic: bool,
) -> None:
    """Whatever a client sends on the lease stream, the daemon answers with acks, grants, revokes or one
    documented error, then ends the stream; it keeps serving, its tenants stay well formed, and no reported
    time makes a tenant's GPU seconds negative or not a number."""
    with lease_socket(server) as s:
        with contextlib.suppress(OSError):  # the daemon may end the stream before it has read everything
            s.sendall((MAGIC if with_magic else b"") + b"".join(frames))
            s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError, FrameError):
            replies = replies_until_closed(s)
            errors = [r.error.code for r in replies if r.WhichOneof("kind") == "error"]
            assert set(errors) <= LEASE_ERRORS and len(errors) <= 1, errors
    with DaemonClient(server.socket) as c:
        assert c.status().caller_pid == os.getpid()
        tenants = c.tenants()
    assert len({t.name for t in tenants}) == len(tenants)
    for t in tenants:
        validate_tenant_name(t.name)
        assert WEIGHT_MIN <= t.weight <= WEIGHT_MAX, t
        assert math.isfinite(t.gpu_seconds) and t.gpu_seconds >= 0, t
