"""Root inside a container (its own pid namespace, as in a pod) reaching the daemon's socket: an ordinary caller,
known as CONTAINED_ROOT, never the owner of the tenants the host's root adopted (real daemon, real cgroups)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Daemon, child_env

pytestmark = [pytest.mark.root, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                                   reason="needs root and unshare(1)")]

CALLS = r"""
import sys
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
sock, tenant = sys.argv[1:3]
with DaemonClient(sock, timeout=20) as c:
    print("uid", c.status().caller_uid, "admin", c.status().caller_is_admin)
    for what, call in (
        ("register", lambda: c.register(pb.RegisterRequest(tenant=tenant, weight=1))),
        ("remove", lambda: c.remove(tenant)),
        ("create", lambda: c.register(pb.RegisterRequest(tenant=tenant + "-mine", weight=1))),
    ):
        try:
            call()
            print(what, "OK")
        except DaemonError as e:
            print(what, e.code.name)
    print("list", *["whole" if t.cgroup else "summary" for t in c.tenants() if t.name == tenant])
"""


@pytest.mark.parametrize("namespace", [("--pid",), ("--user", "--map-root-user")])
def test_root_in_a_container_owns_no_adopted_tenant(daemon: Daemon, tenant_prefix: str,
                                                    namespace: tuple[str, ...]) -> None:
    cg = Path(daemon.status()["cgroup_root"]) / f"{tenant_prefix}-pod"
    cg.mkdir()
    name = f"{tenant_prefix}adopted"
    try:
        out = daemon.cli("adopt", "--tenant", name, "--weight", "70", "--cgroup", str(cg))
        assert out.returncode == 0, out.stderr
        calls = subprocess.run(["unshare", *namespace, "--fork", sys.executable, "-c", CALLS, daemon.socket, name],
                               capture_output=True, text=True, env=child_env(), timeout=60)
        assert calls.returncode == 0, calls.stderr
        lines = calls.stdout.split("\n")
        assert lines[0] == "uid 0 admin False", lines  # root where it runs, no admin here
        assert lines[1:4] == ["register PERMISSION_DENIED", "remove PERMISSION_DENIED", "create PERMISSION_DENIED"]
        (t,) = [t for t in daemon.tenants() if t["name"].startswith(name)]
        assert (t["name"], t["weight"]) == (name, 70)
    finally:
        daemon.cli("remove", "--tenant", name)
        cg.rmdir()


def test_a_user_in_a_container_is_not_that_user_on_the_host(daemon: Daemon, tenant_prefix: str) -> None:
    """A process in a container (its own pid namespace) under uid 65534, which root there can take at will, may not
    act as the host's uid 65534: not join its tenant (the move would take it out of its container's cgroup, its
    device rules and limits), not remove it, not make a tenant of its own, not see its processes and usage."""
    from test_security import run_as

    name = f"{tenant_prefix}hosts"
    got = run_as(daemon.socket, 65534, [("create", "register", {"tenant": name, "weight": 50, "keep": True})])
    assert got["create"] == "OK"
    as_user = CALLS.replace("with DaemonClient(sock, timeout=20) as c:", "import os\nclient = DaemonClient(sock, timeout=20)\n"
                            "os.setgroups([])\nos.setgid(65534)\nos.setuid(65534)\nwith client as c:")
    assert as_user != CALLS
    try:
        calls = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", as_user, daemon.socket, name],
                               capture_output=True, text=True, env=child_env(), timeout=60, cwd="/tmp")
        assert calls.returncode == 0, calls.stderr
        lines = calls.stdout.split("\n")
        assert lines[0] == "uid 65534 admin False", lines
        assert lines[1:4] == ["register PERMISSION_DENIED", "remove PERMISSION_DENIED", "create PERMISSION_DENIED"]
        assert lines[4] == "list summary", "another user's tenant: its processes, cgroup and usage are not shown"
        (t,) = [t for t in daemon.tenants() if t["name"] == name]
        assert t["weight"] == 50
        assert not [t for t in daemon.tenants() if t["name"] == name + "-mine"]
    finally:
        daemon.cli("remove", "--tenant", name)


IN_OWN_USER_NS = r"""
import ctypes, os, sys
from unisched.transport.client import DaemonClient, DaemonError  # imported as root: its files may be root's alone
from unisched_wire import unisched_pb2 as pb
import grpc._channel, grpc._utilities, grpc._interceptor  # what grpc imports when the first channel is made
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER, as toolbox or `podman unshare`
    print("unshare", os.strerror(ctypes.get_errno()))
    sys.exit(0)
"""


def test_a_user_in_a_user_namespace_of_its_own_is_that_user(daemon: Daemon, tenant_prefix: str) -> None:
    """A host user in the host's pid namespace inside a user namespace it made (toolbox, `podman unshare`) is that
    user, as the kernel takes it to be for its files: it owns that user's tenants (removes its own), sees them whole,
    and is no admin. Root doing the same is known as CONTAINED_ROOT (test_root_in_a_container_owns_no_adopted_tenant)."""
    from test_security import run_as

    name = f"{tenant_prefix}toolbox"
    got = run_as(daemon.socket, 65534, [("create", "register", {"tenant": name, "weight": 50, "keep": True})])
    assert got["create"] == "OK"
    script = IN_OWN_USER_NS + CALLS.replace("import sys\n", "", 1)
    try:
        calls = subprocess.run([sys.executable, "-c", script, daemon.socket, name], capture_output=True, text=True,
                               env=child_env(), timeout=60, cwd="/tmp")
        assert calls.returncode == 0, calls.stderr
        lines = calls.stdout.split("\n")
        if lines[0].startswith("unshare"):
            pytest.skip(f"unprivileged user namespaces are not allowed here ({lines[0]})")
        assert lines[0] == "uid 65534 admin False", lines
        assert lines[1:3] == ["register OK", "remove OK"], lines  # its own tenant: joins it, then removes it
        assert not [t for t in daemon.tenants() if t["name"] == name]
    finally:
        daemon.cli("remove", "--tenant", name)
        daemon.cli("remove", "--tenant", name + "-mine")
