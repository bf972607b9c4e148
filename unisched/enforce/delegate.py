"""Running in a cgroup subtree delegated by systemd (Delegate=yes): the daemon moves itself into a leaf of
its unit's cgroup and puts tenants beside it.

Why: on cgroup v2 a cgroup that has children with controllers may hold no processes ("no internal
processes"), and systemd 252 has no DelegateSubgroup=, so the unit's main process starts in the unit's own
cgroup. `unisched serve --delegated` moves the daemon to <unit>/daemon (DAEMON_LEAF) before it starts any
thread, and its tenants live under <unit>/tenants (TENANTS_DIR), inside the subtree systemd handed over.

The unit cgroup is the one systemd put the daemon in: the unified hierarchy's ("0::") on cgroup v2, the
name=systemd hierarchy's on a v1 host. On v1 the freezer hierarchy is not systemd's, so the same path is
created there: daemon and tenants sit at <freezer mount>/<unit>/{daemon,tenants}.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DAEMON_LEAF", "TENANTS_DIR", "DelegationError", "enter_delegated_leaf", "unit_cgroup"]

DAEMON_LEAF = "daemon"
TENANTS_DIR = "tenants"


class DelegationError(RuntimeError):
    """--delegated cannot be honoured; the message says why."""


def unit_cgroup(proc_cgroup: str, kind: str) -> str:
    """The cgroup systemd placed this process in ("/system.slice/unisched.service"), from /proc/PID/cgroup.

    A daemon that already moved itself (a restart in place) is in <unit>/daemon: that is still its unit."""
    wanted = "" if kind == "v2" else "name=systemd"
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == wanted:
            if Path(path).name == DAEMON_LEAF:
                path = str(Path(path).parent)
            if path in ("", "/"):
                raise DelegationError(
                    "--delegated: the daemon is in the root cgroup; run it from a systemd unit with Delegate=yes"
                )
            return path
    hierarchy = "the unified (0::)" if kind == "v2" else "the name=systemd"
    raise DelegationError(f"--delegated: /proc/self/cgroup has no line for {hierarchy} hierarchy")


def enter_delegated_leaf(kind: str, mount: Path, pid: int | None = None) -> str:
    """Move process `pid` (default: this one) into <unit>/daemon under `mount`; return the tenants' subtree
    relative to the hierarchy's root ("system.slice/unisched.service/tenants")."""
    pid = os.getpid() if pid is None else pid
    unit = unit_cgroup(Path(f"/proc/{pid}/cgroup").read_text(), kind)
    leaf = mount / unit.lstrip("/") / DAEMON_LEAF
    try:
        leaf.mkdir(parents=True, exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(pid))
    except OSError as e:
        raise DelegationError(f"--delegated: cannot move the daemon into {leaf}: {e.strerror or e}") from None
    return f"{unit.strip('/')}/{TENANTS_DIR}"
