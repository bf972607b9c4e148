"""Who may do what, and how much: non-admin callers (a child that really drops to another uid, so SO_PEERCRED
reports that uid), pids that are not the caller's own, and bounds on names, counts and message sizes.

The real-daemon tests need root and a freezer; bounds and what others can read run against an in-process server
with fake cgroups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import Daemon, child_env, needs_freezer
from inproc import InProcessServer, in_process_server

from unisched.scheduler.registration import MAX_USER_TENANTS
from unisched.transport.client import DaemonClient, DaemonError
from unisched.transport.server import MAX_MESSAGE_BYTES
from unisched_wire import unisched_pb2 as pb

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")

# A client that imports everything as root, creates its channel (which connects lazily), then drops to UID for
# good: the daemon sees UID through SO_PEERCRED. It runs the calls named on its command line and prints, as
# JSON, the status code name of each ("OK" or the refusal).
AS_USER = r"""
import json, os, sys
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
sock, uid, calls = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
c = DaemonClient(sock)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
out = {}
s = c.status()
out["identity"] = [s.caller_uid, s.caller_is_admin, s.caller_pid == os.getpid()]
for label, method, kwargs in calls:
    try:
        if method == "set_weight":
            c.set_weight(**kwargs)
        elif method == "set_limit":
            c.set_limit(pb.SetLimitRequest(**kwargs))
        elif method == "adopt":
            c.adopt(pb.AdoptRequest(**kwargs))
        elif method == "remove":
            c.remove(**kwargs)
        elif method == "register":
            c.register(pb.RegisterRequest(**kwargs))
        elif method == "register_until_refused":
            n = 0
            while n < 200:
                c.register(pb.RegisterRequest(tenant=f"{kwargs['prefix']}{n}", keep=True))
                n += 1
            out["created"] = n
        elif method == "tenants":
            out[label + "_reply"] = [
                {"name": t.name, "owner_uid": t.owner_uid, "pids": list(t.pids), "cgroup": t.cgroup} for t in c.tenants()
            ]
        out[label] = "OK"
    except DaemonError as e:
        out[label] = e.code.name
        if method == "register_until_refused":
            out["created"] = n
    out[label + "_cgroup"] = open("/proc/self/cgroup").read()
print(json.dumps(out))
"""


def run_as(socket: str, uid: int, calls: list[tuple[str, str, dict]]) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(
        [sys.executable, "-c", AS_USER, socket, str(uid), json.dumps(calls)],
        capture_output=True, text=True, timeout=60, env=child_env(), cwd="/tmp",
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@needs_root
@needs_freezer
@pytest.mark.root
def test_non_admin_cannot_touch_what_it_does_not_own(daemon: Daemon, tenant_prefix: str) -> None:
    owned, mine, other = f"{tenant_prefix}root", f"{tenant_prefix}mine", f"{tenant_prefix}adopted"
    daemon.cli("run", "--tenant", owned, "--weight", "300", "--keep", "--", "true", check=True)
    with DaemonClient(daemon.socket) as admin:
        admin.set_limit(pb.SetLimitRequest(tenant=owned, render=3))
    before = {t["name"]: t for t in daemon.tenants()}

    got = run_as(daemon.socket, 65534, [
        ("set_weight_other", "set_weight", {"tenant": owned, "weight": 5000}),
        ("set_limit_other", "set_limit", {"tenant": owned, "render": 0, "memory_bytes": 1}),
        ("adopt_tenant_cgroup", "adopt", {"tenant": other, "cgroup": daemon.cgroup(owned), "weight": 100}),
        ("adopt_root_cgroup", "adopt", {"tenant": other, "cgroup": "/"}),
        ("remove_other", "remove", {"tenant": owned}),
        ("join_other", "register", {"tenant": owned}),
        ("create_over_max_weight", "register", {"tenant": mine, "weight": 101}),
        ("create", "register", {"tenant": mine, "weight": 100, "keep": True}),
        ("raise_own_over_max_weight", "register", {"tenant": mine, "weight": 5000}),
        ("set_weight_own", "set_weight", {"tenant": mine, "weight": 50}),
        ("set_limit_own", "set_limit", {"tenant": mine, "render": 100}),
        ("name_too_long", "register", {"tenant": "x" * 64}),
        ("many", "register_until_refused", {"prefix": f"{tenant_prefix}n"}),
    ])
    assert got["identity"] == [65534, False, True]
    denied = ["set_weight_other", "set_limit_other", "adopt_tenant_cgroup", "adopt_root_cgroup", "remove_other",
              "join_other", "create_over_max_weight", "raise_own_over_max_weight", "set_weight_own", "set_limit_own",
              "many"]
    assert {k: got[k] for k in denied} == dict.fromkeys(denied, "PERMISSION_DENIED")
    assert got["create"] == "OK" and got["name_too_long"] == "INVALID_ARGUMENT"
    # refused calls did not move the caller: before it created its own tenant it was still where it started
    assert daemon.cgroup(owned) not in got["join_other_cgroup"]
    assert f"{daemon.cgroup(mine)}\n" in got["create_cgroup"]
    # the number of tenants one uid may create is bounded (it already had one)
    assert got["created"] == MAX_USER_TENANTS - 1

    after = {t["name"]: t for t in daemon.tenants()}
    assert other not in after and not any(t["adopted"] for t in after.values())
    keys = ("weight", "base_weight", "owner_uid", "caps", "cgroup")
    assert {k: after[owned][k] for k in keys} == {k: before[owned][k] for k in keys}
    assert after[mine]["owner_uid"] == 65534 and after[mine]["base_weight"] == 100
    assert sum(1 for t in after.values() if t["owner_uid"] == 65534) == MAX_USER_TENANTS

    # another non-admin cannot join, re-weight or remove the first one's tenant
    got2 = run_as(daemon.socket, 65533, [
        ("join", "register", {"tenant": mine}),
        ("set_weight", "set_weight", {"tenant": mine, "weight": 1}),
        ("remove", "remove", {"tenant": mine}),
    ])
    assert [got2["join"], got2["set_weight"], got2["remove"]] == ["PERMISSION_DENIED"] * 3
    assert daemon.cgroup(mine) not in got2["join_cgroup"]
    assert {t["name"]: t["base_weight"] for t in daemon.tenants()}[mine] == 100


# Register request fields: the daemon moves the process SO_PEERCRED names, never one a request names. A forged
# field (an unknown field number carrying another pid) must change nothing.
CALLER = r"""
import json, os, sys, grpc
from unisched_wire import unisched_pb2 as pb
sock, tenant, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])

def varint(n):
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out

forged = pb.RegisterRequest(tenant=tenant, weight=100).SerializeToString()
for field in (7, 15, 99):  # unknown varint fields holding the victim's pid
    forged += varint(field << 3) + varint(victim)
with grpc.insecure_channel(f"unix:{sock}") as ch:
    reply = ch.unary_unary("/unisched.v1.Unisched/Register", request_serializer=lambda b: b,
                           response_deserializer=pb.Tenant.FromString)(forged, timeout=10)
print(json.dumps({"pid": os.getpid(), "reply_pids": list(reply.pids)}), flush=True)
sys.stdin.read()  # stay alive (and in the cgroup) until the test has looked
"""


@needs_root
@needs_freezer
@pytest.mark.root
def test_register_moves_the_caller_and_no_other_pid(daemon: Daemon, tenant_prefix: str) -> None:
    fields = {f.name for f in pb.RegisterRequest.DESCRIPTOR.fields}
    assert not fields & {"pid", "pids", "uid", "gid", "tid"}, "identity must never be a request field"
    tenant = f"{tenant_prefix}pid"
    victim = subprocess.Popen(["sleep", "60"])
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, daemon.socket, tenant, str(victim.pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd="/tmp",
    )
    try:
        assert caller.stdout is not None and caller.stdin is not None
        line = caller.stdout.readline()
        assert line, "the caller exited without registering"
        got = json.loads(line)
        assert got["pid"] == caller.pid and got["reply_pids"] == [caller.pid]
        procs = [int(p) for p in (daemon.cgroup_dir(tenant) / "cgroup.procs").read_text().split()]
        assert procs == [caller.pid], f"the tenant's cgroup holds {procs}, not just the caller {caller.pid}"
        for pid in (victim.pid, os.getpid()):
            assert daemon.cgroup(tenant) not in Path(f"/proc/{pid}/cgroup").read_text(), f"pid {pid} was moved"
        shown = next(t for t in daemon.tenants() if t["name"] == tenant)
        assert shown["pids"] == [caller.pid]
        caller.stdin.close()
        assert caller.wait(timeout=20) == 0
    finally:
        for p in (caller, victim):
            p.kill()
            p.wait(timeout=10)
        for f in (caller.stdin, caller.stdout):
            if f is not None:
                f.close()


@needs_root
@needs_freezer
@pytest.mark.root
def test_tenant_named_like_a_cgroup_file_is_refused_cleanly(daemon: Daemon) -> None:
    """A tenant name like a cgroup interface file (cgroup.procs exists in every cgroup of v1 and v2) is refused
    with its reason, not as an unknown gRPC error (the name rule refuses it first; a mkdir that meets such a file
    says so too)."""
    out = daemon.cli("run", "--tenant", "cgroup.procs", "--", "true")
    assert out.returncode != 0 and "interface file" in out.stderr, out.stderr
    assert daemon.status()["tenants"] == 0
    assert "Traceback" not in daemon.log_path.read_text()


# --- in-process server (fake cgroups): bounds, and what others can read ----------------------------------
@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[InProcessServer]:
    with in_process_server(tmp_path / "state") as s:
        yield s


def _code(f) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    try:
        f()
        return grpc.StatusCode.OK, ""
    except DaemonError as e:
        assert e.code is not None
        return e.code, str(e)


def test_names_lists_and_messages_are_bounded(inproc: InProcessServer) -> None:
    big = 60_000
    with DaemonClient(inproc.socket) as c:
        assert _code(lambda: c.register(pb.RegisterRequest(tenant="n" * 63)))[0] is grpc.StatusCode.OK
        assert _code(lambda: c.register(pb.RegisterRequest(tenant="n" * 64)))[0] is grpc.StatusCode.INVALID_ARGUMENT
        # echoing a huge request in the error made the error itself too big for gRPC's metadata limit: the
        # client then got RESOURCE_EXHAUSTED ("metadata size exceeds hard limit") instead of the reason
        for what, call in [
            ("name", lambda: c.register(pb.RegisterRequest(tenant="y" * big))),
            ("engines", lambda: c.register(pb.RegisterRequest(tenant="e", engines=["warp"] * 5000))),
            ("gpus", lambda: c.register(pb.RegisterRequest(tenant="g", gpus=list(range(10_000))))),
            ("cgroup", lambda: c.adopt(pb.AdoptRequest(tenant="c", cgroup="/" + "z" * big))),
            ("set-weight", lambda: c.set_weight("w" * big, 5)),
            ("set-limit", lambda: c.set_limit(pb.SetLimitRequest(tenant="l" * big, render=1))),
        ]:
            code, message = _code(call)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), f"{what}: {code} {message[:200]}"
            assert len(message) < 1024, f"{what}: a {len(message)}-character error"
        # messages: up to the limit they are read (and refused for what they say), past it refused unread
        at_limit = pb.RegisterRequest(tenant="x" * (MAX_MESSAGE_BYTES - 4))
        assert at_limit.ByteSize() == MAX_MESSAGE_BYTES
        assert _code(lambda: c.register(at_limit))[0] is grpc.StatusCode.INVALID_ARGUMENT
        over = pb.RegisterRequest(tenant="x" * (MAX_MESSAGE_BYTES - 3))
        assert over.ByteSize() == MAX_MESSAGE_BYTES + 1
        assert _code(lambda: c.register(over))[0] is grpc.StatusCode.RESOURCE_EXHAUSTED
        st = c.status()
    assert st.tenants == 1 and [s.name for s in inproc.engine.snapshots()] == ["n" * 63]


@needs_root
def test_the_public_summary_keeps_no_measure_of_a_tenants_work() -> None:
    from unisched.transport.convert import public_summary

    t = pb.Tenant(name="x", weight=100, pids=[1], gpu_seconds=2.0, measured_share=0.5, slices=3, overrun_s=0.1,
                  unit_ms=4.0, turn_ms=40.0, cgroup="/unisched/x", memory_bytes=5, devices="c 195:0 rw")
    public_summary(t)
    assert (t.name, t.weight) == ("x", 100)
    assert not (t.pids or t.gpu_seconds or t.measured_share or t.slices or t.overrun_s or t.unit_ms or t.turn_ms
                or t.cgroup or t.memory_bytes or t.devices)


def test_non_admin_sees_only_a_public_summary_of_others(inproc: InProcessServer) -> None:
    with DaemonClient(inproc.socket) as c:
        c.register(pb.RegisterRequest(tenant="private", weight=200))  # this process, in a fake cgroup
    got = run_as(inproc.socket, 65534, [("mine", "register", {"tenant": "mine"}), ("list", "tenants", {})])
    assert got["mine"] == "OK"
    shown = {t["name"]: t for t in got["list_reply"]}
    # the public summary of another's tenant: name, owner, weight, state, shares; no processes, no cgroup
    assert shown["private"]["owner_uid"] == 0
    assert shown["private"]["pids"] == [] and shown["private"]["cgroup"] == "", shown["private"]
    # its own tenant in full
    assert shown["mine"]["owner_uid"] == 65534 and shown["mine"]["cgroup"] == "/unisched/mine" and shown["mine"]["pids"]
    # no identity at all (as over the TLS listener; the Unix socket has no identity-less door): summaries only
    door = inproc.doors.grpc
    door.caller = lambda cred: None
    try:
        with DaemonClient(inproc.socket) as anonymous:
            assert all(not t.pids and not t.cgroup for t in anonymous.tenants())
    finally:
        door.caller = lambda cred: cred
    with DaemonClient(inproc.socket) as admin:
        assert all(t.cgroup for t in admin.tenants())  # admins see everything
