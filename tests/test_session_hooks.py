"""GPU session admission end to end on a real daemon: `unisched run` installs the seccomp hook, the daemon
admits or refuses each RM_ALLOC by the tenant's caps, and `unisched tenants` shows sessions and refusals.
/dev/null stands in for /dev/nvidiactl (a call let through fails there with ENOTTY; a refused one with EPERM)."""

from __future__ import annotations

import json
import select
import subprocess
import sys

import pytest
from conftest import ROOT, Daemon, child_env

ENOTTY, EPERM = "25", "1"
IOCTLS = str(ROOT / "tests" / "nv_ioctls.py")


def _hooks_reason() -> str | None:
    from unisched.enforce.seccomp.abi import probe

    return probe()


pytestmark = pytest.mark.skipif(_hooks_reason() is not None, reason=f"seccomp user notification: {_hooks_reason()}")


def test_render_cap_refuses_the_second_context_and_counts_it(daemon: Daemon, tenant_prefix: str) -> None:
    name = f"{tenant_prefix}gfx"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    out = daemon.cli("set-limit", "--tenant", name, "--render", "1")
    assert out.returncode == 0 and "render 1" in out.stdout, out.stderr
    run = daemon.cli("run", "--tenant", name, "--", sys.executable, IOCTLS,
                     "alloc:0xCB97:1", "alloc:0xCB97:2", "alloc:0xCBC0:3", "free:1", "alloc:0xCB97:4")
    assert run.returncode == 0, run.stderr
    # graphics let through, second graphics refused, compute never capped, after the free a new one fits
    assert run.stdout.split() == [ENOTTY, EPERM, ENOTTY, ENOTTY, ENOTTY]
    t = next(t for t in daemon.tenants() if t["name"] == name)
    assert t["refusals"] == {"graphics": 1}
    assert t["sessions"].get("graphics", 0) == 0, "the process exited: its sessions are gone"
    log = [json.loads(x) for x in daemon.log_path.read_text().splitlines() if x.startswith("{")]
    refused = [e for e in log if e["event"] == "session refused"]
    assert refused and refused[-1]["tenant"] == name and refused[-1]["h_class"] == "0xCB97"


def test_without_hooks_nothing_is_refused(daemon: Daemon, tenant_prefix: str) -> None:
    name = f"{tenant_prefix}free"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "0", check=True)
    hooked = daemon.cli("run", "--tenant", name, "--", sys.executable, IOCTLS, "alloc:0xCB97:1")
    unhooked = daemon.cli("run", "--tenant", name, "--no-session-hooks", "--", sys.executable, IOCTLS, "alloc:0xCB97:1")
    assert hooked.stdout.split() == [EPERM]
    assert unhooked.stdout.split() == [ENOTTY]


def test_status_reports_the_hooks(daemon: Daemon) -> None:
    st = daemon.status()
    assert st["session_hooks"] == "on"
    assert st["agent_socket"].endswith("seccomp-agent.sock")


def test_allocations_that_are_not_sessions_pass_and_only_sessions_are_refused(daemon: Daemon, tenant_prefix: str) -> None:
    """What a CUDA context looks like to the hooks: many allocations of channels, copy engines, TSGs and memory
    (answered by the supervisor's thread, never asked of the engine) around the few that open a session."""
    name = f"{tenant_prefix}ctx"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "0", check=True)
    others = [f"alloc:{cls:#x}:{0x100 + i:#x}" for i, cls in enumerate([0xC86F, 0xC8B5, 0xA06C, 0x0040, 0x003E] * 20)]
    calls = [*others[:50], "alloc:0xCB97:1", "alloc:0xCBC0:2", *others[50:], "alloc:0xCB97:3", "free:0x100"]
    run = daemon.cli("run", "--tenant", name, "--", sys.executable, IOCTLS, *calls)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [ENOTTY] * 50 + [EPERM, ENOTTY] + [ENOTTY] * 50 + [EPERM, ENOTTY]
    t = next(t for t in daemon.tenants() if t["name"] == name)
    assert t["refusals"] == {"graphics": 2}
    assert t["sessions"].get("compute", 0) == 0, "the process exited: its compute session is gone"


STEPPED = """
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open("/dev/null", os.O_RDWR)
for i, line in enumerate(sys.stdin):
    buf = ctypes.create_string_buffer(struct.pack("=IIIIQII", 0xC1D00001, 0xC1D00001, 0x10 + i, int(line, 0), 0, 0, 0), 32)
    rc = libc.ioctl(fd, ctypes.c_ulong((3 << 30) | (32 << 16) | (ord("F") << 8) | 0x2B), buf)
    print(ctypes.get_errno() if rc < 0 else 0, flush=True)
"""


def test_daemon_shutdown_with_a_hooked_tenant_running(daemon: Daemon, tenant_prefix: str) -> None:
    """Stopping the daemon joins the supervisors' threads (it exits promptly) and the tenant carries on:
    its later session allocations fail with ENOSYS instead of waiting."""
    name = f"{tenant_prefix}live"
    tenant = subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", name, "--",
         sys.executable, "-c", STEPPED],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=child_env(),
    )  # fmt: skip
    assert tenant.stdin is not None and tenant.stdout is not None

    def call(h_class: int) -> str:
        assert tenant.stdin is not None and tenant.stdout is not None
        tenant.stdin.write(f"{h_class:#x}\n")
        tenant.stdin.flush()
        ready, _, _ = select.select([tenant.stdout], [], [], 20)
        assert ready, "the tenant did not answer"
        return tenant.stdout.readline().strip()

    try:
        assert call(0xC86F) == ENOTTY
        assert call(0xCB97) == ENOTTY
        assert daemon.stop() == 0
        assert call(0xCB97) == "38"  # ENOSYS: the listener is gone with the daemon, nothing waits
        tenant.stdin.close()
        assert tenant.wait(20) == 0
    finally:
        if tenant.poll() is None:
            tenant.kill()
            tenant.wait(10)
        tenant.stdout.close()
