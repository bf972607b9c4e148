"""A real gRPC server on a temporary Unix socket; identity comes from SO_PEERCRED, never from a request."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import child_env
from inproc import InProcessServer, in_process_server

from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc


@pytest.fixture
def server(tmp_path: Path) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state") as s:
        yield s


def test_status_sees_the_callers_own_pid_and_uid(server: InProcessServer) -> None:
    with DaemonClient(server.socket) as c:
        s = c.status()
    assert s.caller_pid == os.getpid()
    assert s.caller_uid == os.getuid()


def test_register_moves_the_caller_and_only_the_caller(server: InProcessServer) -> None:
    with DaemonClient(server.socket) as c:
        t = c.register(pb.RegisterRequest(tenant="web", weight=200))
    assert t.name == "web" and t.weight == 200
    assert server.driver.pids("/unisched/web") == [os.getpid()]


def test_bad_requests_get_clear_errors(server: InProcessServer) -> None:
    with DaemonClient(server.socket) as c:
        for req, code, text in [
            (pb.RegisterRequest(tenant="bad name!", weight=1), grpc.StatusCode.INVALID_ARGUMENT, "tenant name"),
            # a controller's file not made yet: the tenant's cgroup would make root's `+hugetlb` fail host-wide
            (pb.RegisterRequest(tenant="hugetlb.2MB.max", keep=True), grpc.StatusCode.INVALID_ARGUMENT,
             "cgroup interface files"),
            (pb.RegisterRequest(tenant="w", weight=10**9), grpc.StatusCode.INVALID_ARGUMENT, "weight must be in"),
            (pb.RegisterRequest(tenant="e", engines=["warp"]), grpc.StatusCode.INVALID_ARGUMENT, "engines must be"),
        ]:
            with pytest.raises(DaemonError) as e:
                c.register(req)
            assert e.value.code is code and text in str(e.value)
        with pytest.raises(DaemonError) as e:
            c.set_weight("ghost", 10)
        assert e.value.code is grpc.StatusCode.NOT_FOUND
        with pytest.raises(DaemonError) as e:
            c.adopt(pb.AdoptRequest(tenant="x", cgroup="../../etc"))
        assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert c.status().tenants == 0  # nothing half-created


def test_oversized_message_is_refused(server: InProcessServer) -> None:
    channel = grpc.insecure_channel(f"unix:{server.socket}")
    stub = pb_grpc.UnischedStub(channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError) as e:
        stub.Register(pb.RegisterRequest(tenant="x" * 200_000), timeout=10)
    assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_non_admin_cannot_change_weights_and_is_seen_as_itself(server: InProcessServer) -> None:
    with DaemonClient(server.socket) as c:
        c.register(pb.RegisterRequest(tenant="owned", weight=100))
    # Start as root (the interpreter lives under /root), import everything, then drop to nobody for good:
    # SO_PEERCRED reports the credentials at connect(), which happens after the drop.
    code = """
import os, sys, grpc
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
c = DaemonClient(sys.argv[1])  # channels connect lazily: the connect() happens after the drop
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
s = c.status()
print("uid", s.caller_uid, "admin", s.caller_is_admin)
try:
    c.set_weight("owned", 5000)
    print("set-weight allowed")
except DaemonError as e:
    print("set-weight", e.code.name)
try:
    c.register(pb.RegisterRequest(tenant="owned"))
    print("join allowed")
except DaemonError as e:
    print("join", e.code.name)
"""
    out = subprocess.run(
        [sys.executable, "-c", code, server.socket], capture_output=True, text=True, timeout=60,
        env=child_env(), cwd="/tmp",
    )
    assert out.returncode == 0, out.stderr
    assert "uid 65534 admin False" in out.stdout
    assert "set-weight PERMISSION_DENIED" in out.stdout
    assert "join PERMISSION_DENIED" in out.stdout
    assert {s.name: s.weight for s in server.engine.snapshots()} == {"owned": 100}


def test_calls_that_wait_for_a_busy_loop_are_served_not_cancelled(server: InProcessServer) -> None:
    """Calls made while the daemon's loop is held (here 1.5 s: a stand-in for a slow tick) wait and are all
    answered once it is free; nothing between the socket and the loop drops or cancels them meanwhile."""
    held, release = threading.Event(), threading.Event()

    def block() -> None:
        held.set()
        release.wait(60)

    clients = [DaemonClient(server.socket, timeout=30) for _ in range(4)]
    seen: list[int] = []
    try:
        server.loop.call_soon_threadsafe(block)
        assert held.wait(30)
        threads = [threading.Thread(target=lambda c=c: seen.append(c.status().caller_pid)) for c in clients]
        for t in threads:
            t.start()
        time.sleep(1.5)  # the calls wait while the loop is held (the scenario, not a wait for a condition)
        assert not seen
        release.set()
        for t in threads:
            t.join(30)
    finally:
        release.set()
        for c in clients:
            c.close()
    assert seen == [os.getpid()] * 4
