"""The daemon's sockets, tried against a real daemon (root, real cgroups): Unix sockets only, one per protocol.

- no TCP or UDP socket at all without `listen` (a loopback port would be open to every local user, with no
  SO_PEERCRED to say who calls);
- gRPC on the Unix socket knows its caller: root as root and admin, nobody as nobody;
- each socket refuses the other protocol at once and keeps serving: the gRPC socket answers lease bytes with a
  LeaseError naming the lease socket, the lease socket hangs up on HTTP/2;
- `unisched run` names both sockets to its command.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import Daemon, child_env

from unisched.scheduler.config import runtime_agent_socket_beside
from unisched.transport.client import DaemonClient
from unisched.transport.grpcdoor import PREFACE
from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc
from unisched_wire.leasewire import MAGIC, MAX_REPLY_BYTES, FrameReader, frame

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")]
NOBODY = 65534
REFUSED_WITHIN_S = 2.0
"""A wrong protocol is refused at once: well inside the 5 s opening deadline a silent connection gets."""


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[len("socket:["):-1]))
    return out


def _inet_inodes(pid: int) -> dict[int, str]:
    """Inodes of the TCP and UDP sockets (v4 and v6) in the process's network namespace, with their table."""
    out = {}
    for table in ("tcp", "tcp6", "udp", "udp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            out[int(fields[9])] = f"{table} {fields[1]} state {fields[3]}"
    return out


def _unix_listeners(pid: int) -> set[str]:
    """Paths of the Unix sockets the process listens on."""
    mine = _socket_inodes(pid)
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and int(fields[6]) in mine and fields[5] == "01":  # 01: listening
            paths.add(fields[7])
    return paths


def test_the_daemon_has_no_tcp_or_udp_socket(daemon: Daemon) -> None:
    with DaemonClient(daemon.socket) as c:  # a gRPC call in flight and done: no relay connection either
        assert c.status().caller_pid == os.getpid()
        pid = daemon.proc.pid
        inet = _inet_inodes(pid)
        assert not {i: inet[i] for i in _socket_inodes(pid) if i in inet}, "the daemon holds TCP/UDP sockets"
    agent = str(Path(daemon.socket).with_name("seccomp-agent.sock"))
    assert _unix_listeners(pid) == {daemon.socket, daemon.lease_socket, agent, runtime_agent_socket_beside(daemon.socket)}


WHO = r"""
import json, os, sys
from unisched.transport.client import DaemonClient
sock, uid = sys.argv[1], int(sys.argv[2])
c = DaemonClient(sock)  # made as root; it connects at the first call, after the drop
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
with c:
    s = c.status()
print(json.dumps({"uid": s.caller_uid, "admin": s.caller_is_admin, "own_pid": s.caller_pid == os.getpid()}))
"""


@pytest.mark.parametrize(("uid", "admin"), [(0, True), (NOBODY, False)])
def test_grpc_calls_on_the_unix_socket_know_their_caller(daemon: Daemon, uid: int, admin: bool) -> None:
    out = subprocess.run([sys.executable, "-c", WHO, daemon.socket, str(uid)], capture_output=True, text=True,
                         timeout=60, env=child_env(), cwd="/tmp")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"uid": uid, "admin": admin, "own_pid": True}


def _read_until_closed(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(1 << 16):
        got += chunk
    return got


def test_the_grpc_socket_answers_lease_bytes_with_where_to_go(daemon: Daemon, tenant_prefix: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(daemon.socket)
        start = time.monotonic()
        s.sendall(MAGIC + frame(pb.LeaseRequest(hello=pb.LeaseHello(tenant=f"{tenant_prefix}x")), ))
        got = _read_until_closed(s)
        took = time.monotonic() - start
    replies = [pb.LeaseReply.FromString(p) for p in FrameReader(MAX_REPLY_BYTES).feed(got)]
    assert len(replies) == 1 and replies[0].WhichOneof("kind") == "error", replies
    assert replies[0].error.code == "FAILED_PRECONDITION" and daemon.lease_socket in replies[0].error.details
    assert took < REFUSED_WITHIN_S
    assert not any(t["name"] == f"{tenant_prefix}x" for t in daemon.tenants())  # and it still serves


def test_the_lease_socket_hangs_up_on_http2(daemon: Daemon) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(daemon.lease_socket)
        start = time.monotonic()
        s.sendall(PREFACE)
        assert _read_until_closed(s) == b""
        assert time.monotonic() - start < REFUSED_WITHIN_S
    with grpc.insecure_channel(f"unix:{daemon.lease_socket}") as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.UnischedStub(ch).Status(pb.StatusRequest(), timeout=5)  # type: ignore[no-untyped-call]
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    with DaemonClient(daemon.socket) as c:
        assert c.status().caller_pid == os.getpid()


def test_run_names_both_sockets_to_its_command(daemon: Daemon, tenant_prefix: str) -> None:
    show = "import os, json; print(json.dumps([os.environ.get('UNISCHED_SOCKET'), os.environ.get('UNISCHED_LEASE_SOCKET')]))"
    out = daemon.cli("run", "--tenant", f"{tenant_prefix}env", "--no-session-hooks", "--", sys.executable, "-c", show,
                     check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [daemon.socket, daemon.lease_socket]
