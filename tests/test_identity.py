"""Who the daemon thinks is calling, tried against a real daemon (root, real cgroups, real processes):

- a connection stays bound to the process that made it: when that process exits and root's process takes its
  pid (placed with /proc/sys/kernel/ns_last_pid), the held connection's Register and lease hello are refused and
  root's process is not moved;
- admin groups come from the uid's group list, not from what the connecting process holds;
- root in its own pid namespace (a container) is not an admin;
- a non-admin sees no usage of other users' tenants;
- what `kernel_cred` gives (nothing pinned) is never asked who the peer is now.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import Daemon, child_env, wait_until

from unisched_wire import unisched_pb2 as pb
from unisched_wire import unisched_pb2_grpc as pb_grpc
from unisched_wire.leasewire import MAGIC, frame

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")]
NOBODY = 65534

# Connects as UID to the lease socket and to the gRPC socket and hands both connected sockets to the test over
# fd 3 (SCM_RIGHTS), then exits: the daemon's SO_PEERCRED for both names this process's pid, which is then free
# for another process to take.
HOLDER = r"""
import os, socket, sys
paths, uid, back = sys.argv[1].split(","), int(sys.argv[2]), socket.socket(fileno=int(sys.argv[3]))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
conns = [socket.socket(socket.AF_UNIX) for _ in paths]
for c, path in zip(conns, paths):
    c.connect(path)
socket.send_fds(back, [b"x"], [c.fileno() for c in conns])
"""

# Drops to the uid, gid and supplementary groups given, then asks the daemon who it is and tries an admin call;
# prints both as JSON. The client is made first (as root: the installed packages may not be readable by the
# uid), and connects lazily, so the daemon sees the process after the drop.
WHOAMI = r"""
import json, os, sys
from unisched.transport.client import DaemonClient, DaemonError
sock, uid, gid, groups, tenant = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
c = DaemonClient(sock)
if uid >= 0:
    os.setgroups(groups); os.setgid(gid); os.setuid(uid)
with c:
    s = c.status()
    try:
        c.set_weight(tenant, 7)
        code = "OK"
    except DaemonError as e:
        code = e.code.name
    print(json.dumps({"admin": s.caller_is_admin, "uid": s.caller_uid, "set_weight": code}))
"""


def _whoami(daemon: Daemon, tenant: str, uid: int = -1, gid: int = -1, groups: tuple[int, ...] = (),
            prefix: tuple[str, ...] = ()) -> dict[str, object]:
    out = subprocess.run(
        [*prefix, sys.executable, "-c", WHOAMI, daemon.socket, str(uid), str(gid), json.dumps(list(groups)), tenant],
        capture_output=True, text=True, timeout=60, env=child_env(), cwd="/tmp",
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.fixture
def root_tenant(daemon_factory, tenant_prefix: str) -> Iterator[tuple[Daemon, str]]:  # type: ignore[no-untyped-def]
    """A daemon whose admin group is `adm`, and a tenant of root's (weight 300) with a live process in it."""
    daemon = daemon_factory("--slice-ms", "20", "--admin-group", "adm")
    name = f"{tenant_prefix}adm"
    holder = subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", name, "--weight", "300",
         "--", "sleep", "120"], env=child_env(), cwd="/tmp",
    )
    try:
        wait_until(lambda: any(t["name"] == name for t in daemon.tenants()), 30, "root's tenant")
        yield daemon, name
    finally:
        holder.kill()
        holder.wait(timeout=10)


PID_ATTEMPTS = 5


def _take_pid(pid: int, group: int) -> subprocess.Popen[bytes] | None:
    """Start a root process (holding `group`) as `pid`, the way an attacker waits for one: ns_last_pid."""
    for _ in range(100):
        if Path(f"/proc/{pid}").exists():
            return None  # someone else took it
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        p = subprocess.Popen(["sleep", "120"], extra_groups=[group])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def _lease_hello(conn: socket.socket, tenant: str, weight: int) -> pb.LeaseReply:
    conn.settimeout(20)
    conn.sendall(MAGIC + frame(pb.LeaseRequest(hello=pb.LeaseHello(tenant=tenant, weight=weight), seq=1)))
    head = b""
    while len(head) < 4:
        chunk = conn.recv(4 - len(head))
        assert chunk, "the daemon closed the lease stream without a reply"
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = conn.recv(n - len(body))
        assert chunk
        body += chunk
    reply: pb.LeaseReply = pb.LeaseReply.FromString(body)
    return reply


def _bridge(conn: socket.socket, opened: list[socket.socket]) -> int:
    """A loopback TCP port whose one connection is spliced onto `conn`, so a gRPC client can speak over a
    Unix connection someone else made. The sockets it opens are added to `opened` for the caller to close."""
    listener = socket.create_server(("127.0.0.1", 0))
    opened.append(listener)
    conn.settimeout(None)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        tcp, _ = listener.accept()
        opened.append(tcp)
        threading.Thread(target=pump, args=(tcp, conn), daemon=True).start()
        pump(conn, tcp)

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def _connections_of_a_pid_root_took(daemon: Daemon, group: int) -> tuple[socket.socket, socket.socket,
                                                                          list[socket.socket], subprocess.Popen[bytes]]:
    """nobody's lease and gRPC connections to the daemon, held on after its process exited, and a root process
    (holding `group`) now in its pid. Another process can take the pid first on a busy host: then again, with a
    new holder, a few times before the test cannot be made here."""
    for _ in range(PID_ATTEMPTS):
        mine, theirs = socket.socketpair()
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"{daemon.lease_socket},{daemon.socket}",
                                   str(NOBODY), str(theirs.fileno())],
                                  pass_fds=[theirs.fileno()], env=child_env(), cwd="/tmp")
        theirs.close()
        _, fds, _, _ = socket.recv_fds(mine, 1, 2)
        assert holder.wait(timeout=20) == 0 and len(fds) == 2
        lease_conn, grpc_conn = (socket.socket(fileno=fd) for fd in fds)
        opened = [lease_conn, grpc_conn, mine]
        victim = _take_pid(holder.pid, group)
        if victim is not None:
            return lease_conn, grpc_conn, opened, victim
        for c in opened:
            c.close()
    pytest.skip(f"another process took the exited holder's pid first, {PID_ATTEMPTS} times in a row")


def test_a_reused_pid_does_not_hand_over_root_rights(root_tenant: tuple[Daemon, str]) -> None:
    """A non-root user's connection whose process exited: root's process takes its pid (root holds the admin
    group). The held connection's Register/hello must not count as admin (groups read from the new /proc/<pid>):
    it would set root's tenant to weight 9999 and move root's process into it."""
    daemon, tenant = root_tenant
    lease_conn, grpc_conn, opened, victim = _connections_of_a_pid_root_took(daemon, grp.getgrnam("adm").gr_gid)
    try:
        where = Path(f"/proc/{victim.pid}/cgroup").read_text()
        reply = _lease_hello(lease_conn, tenant, 9999)
        assert reply.WhichOneof("kind") == "error", reply
        assert reply.error.code == "FAILED_PRECONDITION" and "exited" in reply.error.details

        with grpc.insecure_channel(f"127.0.0.1:{_bridge(grpc_conn, opened)}") as ch, \
                pytest.raises(grpc.RpcError) as err:
            pb_grpc.UnischedStub(ch).Register(pb.RegisterRequest(tenant=tenant, weight=9999), timeout=20)  # type: ignore[no-untyped-call]
        assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION, err.value
        assert "exited" in str(err.value.details())

        assert Path(f"/proc/{victim.pid}/cgroup").read_text() == where, "root's process was moved"
        assert {t["name"]: t["base_weight"] for t in daemon.tenants()}[tenant] == 300
    finally:
        victim.kill()
        victim.wait(timeout=10)
        for c in opened:
            c.close()


def test_admin_group_comes_from_the_uids_group_list(daemon_factory, tenant_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """admin_group = nogroup, nobody's primary group in passwd. nobody counts as admin even when its process
    dropped that gid; uid 65533 (no account, so no groups) does not, even holding the gid as a supplementary
    group: the groups are the uid's, not the process's, which would answer the other way round."""
    nogroup = grp.getgrgid(NOBODY).gr_name
    daemon = daemon_factory("--slice-ms", "20", "--admin-group", nogroup)
    name = f"{tenant_prefix}g"
    daemon.cli("run", "--tenant", name, "--keep", "--", "true", check=True)
    member = _whoami(daemon, name, NOBODY, 65533, ())
    assert member == {"admin": True, "uid": NOBODY, "set_weight": "OK"}
    holder_only = _whoami(daemon, name, 65533, 65533, (NOBODY,))
    assert holder_only == {"admin": False, "uid": 65533, "set_weight": "PERMISSION_DENIED"}


def test_root_in_its_own_pid_namespace_is_not_admin(daemon: Daemon, tenant_prefix: str) -> None:
    """A pod's root (uid 0 in its own pid namespace) is an ordinary user; root on the host stays admin."""
    name = f"{tenant_prefix}ns"
    daemon.cli("run", "--tenant", name, "--keep", "--", "true", check=True)
    assert _whoami(daemon, name) == {"admin": True, "uid": 0, "set_weight": "OK"}
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")
    contained = _whoami(daemon, name, prefix=("unshare", "--pid", "--fork"))
    assert contained == {"admin": False, "uid": 0, "set_weight": "PERMISSION_DENIED"}


LIST_AS = r"""
import json, os, sys
from unisched.transport.client import DaemonClient
sock, uid = sys.argv[1], int(sys.argv[2])
c = DaemonClient(sock)  # as root, connecting lazily (see WHOAMI)
os.setgroups([]); os.setgid(uid); os.setuid(uid)
with c:
    print(json.dumps([
        {"name": t.name, "owner_uid": t.owner_uid, "weight": t.weight, "target_share": t.target_share,
         "gpu_seconds": t.gpu_seconds, "measured_share": t.measured_share, "slices": t.slices,
         "shares": [s.measured_share for s in t.shares]}
        for t in c.tenants()]))
"""


def test_non_admin_sees_no_usage_of_others(daemon: Daemon, tenant_prefix: str) -> None:
    """Through the real socket as nobody: root's busy tenant shows its weight and target share, not its usage
    (gpu_seconds, measured share)."""
    name = f"{tenant_prefix}busy"
    hog = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", name,
                            "--weight", "200", "--", sys.executable, str(Path(__file__).parent / "hog.py"), "--seconds", "60"],
                           env=child_env(), cwd="/tmp", stdout=subprocess.DEVNULL)
    try:
        def used() -> dict[str, object] | None:
            t = next((t for t in daemon.tenants() if t["name"] == name), None)
            return t if t and t["gpu_seconds"] > 0 and t["measured_share"] > 0 else None

        wait_until(used, 30, "root's tenant to show usage to root")
        out = subprocess.run([sys.executable, "-c", LIST_AS, daemon.socket, str(NOBODY)], capture_output=True,
                             text=True, timeout=60, env=child_env(), cwd="/tmp")
        assert out.returncode == 0, out.stderr
        shown = next(t for t in json.loads(out.stdout) if t["name"] == name)
        assert shown["owner_uid"] == 0 and shown["weight"] == 200 and shown["target_share"] > 0
        assert (shown["gpu_seconds"], shown["measured_share"], shown["slices"]) == (0, 0, 0), shown
        assert not any(shown["shares"]), shown
    finally:
        hog.kill()
        hog.wait(timeout=10)


def test_a_kernel_cred_is_never_taken_for_a_pinned_peer() -> None:
    """`kernel_cred` pins nothing (the runtime agent socket's peer may be gone): its pid may name another process by
    now, so whether it runs, its namespaces and admin rights are refused rather than read off that process."""
    from unisched.transport.identity import in_host_namespaces, is_admin, kernel_cred, peer_of

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        raw, pinned = kernel_cred(ours), peer_of(ours)
        assert (raw.pid, raw.uid) == (pinned.pid, pinned.uid) == (os.getpid(), 0)
        for ask in (raw.alive, lambda: in_host_namespaces(raw), lambda: is_admin(raw, None)):
            with pytest.raises(ValueError, match="never pinned"):
                ask()
        assert pinned.alive() and in_host_namespaces(pinned) and is_admin(pinned, None)
        assert pinned.process is not None
        pinned.process.close()


def test_a_process_pinned_by_its_pid_is_alive_until_it_exits() -> None:
    """`pin` (a peer without SO_PEERPIDFD; the process a runtime's hand-over names): alive while that process runs,
    gone once it has exited (its pid may then name another); gone at once when `uid` is given and the pid names
    another user's process."""
    from unisched.transport.identity import pin

    proc = subprocess.Popen(["sleep", "60"])
    try:
        held, other_user = pin(proc.pid), pin(proc.pid, uid=NOBODY)
        assert held.holds_fd and held.alive()
        assert not other_user.alive()
    finally:
        proc.kill()
        proc.wait()
    assert not held.alive()
    held.close()
