"""GPU session admission end to end on a real daemon: `unisched run` installs the seccomp hook, the daemon
admits or refuses each RM_ALLOC by the tenant's caps, and `unisched tenants` shows sessions and refusals.
/dev/null stands in for /dev/nvidiactl (a call let through fails there with ENOTTY; a refused one with EPERM)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, Daemon

ENOTTY, EPERM = "25", "1"
IOCTLS = str(ROOT / "tests" / "nv_ioctls.py")


def _hooks_reason() -> str | None:
    from unisched.enforce.seccomp import probe

    return probe()


pytestmark = pytest.mark.skipif(_hooks_reason() is not None, reason=f"seccomp user notification: {_hooks_reason()}")


def test_render_cap_refuses_the_second_context_and_counts_it(daemon: Daemon, tenant_prefix: str) -> None:
    name = f"{tenant_prefix}gfx"
    assert daemon.cli("run", "--tenant", name, "--", "true").returncode == 0
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
    assert daemon.cli("run", "--tenant", name, "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "0", check=True)
    hooked = daemon.cli("run", "--tenant", name, "--", sys.executable, IOCTLS, "alloc:0xCB97:1")
    unhooked = daemon.cli("run", "--tenant", name, "--no-session-hooks", "--", sys.executable, IOCTLS, "alloc:0xCB97:1")
    assert hooked.stdout.split() == [EPERM]
    assert unhooked.stdout.split() == [ENOTTY]


def test_status_reports_the_hooks(daemon: Daemon) -> None:
    st = daemon.status()
    assert st["session_hooks"] == "on"
    assert st["agent_socket"].endswith("seccomp-agent.sock")
