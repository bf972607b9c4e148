"""The container path for GPU session admission with a real OCI runtime: runc starts a container whose
seccomp profile (deploy/seccomp/unisched-gpu.json: the runtime default plus our rules, resolved for the
container as a runtime resolves a Localhost profile) sends the driver's allocation ioctls to the daemon's runtime
agent socket (listenerPath); the daemon governs the container's sessions by its tenant's caps, and the runtime
default's refusals still hold. /dev/null stands in for /dev/nvidiactl (let through: ENOTTY; refused: EPERM).
Needs root and runc (CI installs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import ROOT, Daemon

RUNC = shutil.which("runc")


def _reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run containers"
    if RUNC is None:
        return "runc is not installed (.ci/run installs it)"
    from unisched.enforce.seccomp.abi import probe

    return probe()


pytestmark = pytest.mark.skipif(_reason() is not None, reason=str(_reason()))


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("seccomp_generate", ROOT / "deploy/seccomp/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()
SHIPPED = json.loads((ROOT / "deploy/seccomp/unisched-gpu.json").read_text())


def make_rootfs(rootfs: Path) -> None:
    """A root with mount points only: the host's /usr (python3) is bound read-only at /usr and tests/ at /t."""
    for d in ("usr", "t", "proc", "dev", "sys", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if Path(f"/{link}").is_symlink():
            (rootfs / link).symlink_to(os.readlink(f"/{link}"))


def bundle(tmp: Path, agent: str, metadata: str, args: list[str], profile: dict[str, Any] = SHIPPED) -> Path:
    b = tmp / "bundle"
    make_rootfs(b / "rootfs")
    subprocess.run([RUNC, "spec"], cwd=b, check=True)  # type: ignore[list-item]
    config = json.loads((b / "config.json").read_text())
    config["process"]["terminal"] = False
    config["process"]["args"] = args
    config["root"] = {"path": "rootfs", "readonly": True}
    config["mounts"] += [
        {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]},
        {"destination": "/t", "type": "bind", "source": str(ROOT / "tests"), "options": ["rbind", "ro"]},
    ]
    caps = set(config["process"]["capabilities"]["bounding"])
    oci = GENERATOR.to_oci(profile, caps)  # what containerd or CRI-O hands runc for a Localhost profile
    oci["listenerPath"] = agent
    oci["listenerMetadata"] = metadata
    config["linux"]["seccomp"] = oci
    (b / "config.json").write_text(json.dumps(config))
    return b


def run_container(tmp: Path, b: Path, name: str) -> subprocess.CompletedProcess[str]:
    state = tmp / "runc-state"
    try:
        return subprocess.run([RUNC, "--root", str(state), "run", "--bundle", str(b), name],  # type: ignore[list-item]
                              capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run([RUNC, "--root", str(state), "delete", "--force", name], capture_output=True)  # type: ignore[list-item]


def test_runc_container_is_governed_through_the_agent_socket(daemon: Daemon, tenant_prefix: str, tmp_path: Path) -> None:
    name = f"{tenant_prefix}ctr"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "1", check=True)
    agent = daemon.status()["runtime_agent_socket"]
    b = bundle(tmp_path, agent, f"tenant={name}",
               ["/usr/bin/python3", "/t/nv_ioctls.py", "alloc:0xCB97:1", "alloc:0xCB97:2", "alloc:0xB8B0:3"])
    out = run_container(tmp_path, b, name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25", "1", "25"], out.stdout  # graphics, refused second graphics, NVDEC
    t = next(t for t in daemon.tenants() if t["name"] == name)
    assert t["refusals"] == {"graphics": 1}


def test_unknown_tenant_in_metadata_is_refused(
    daemon: Daemon, tenant_prefix: str, tmp_path: Path
) -> None:
    agent = daemon.status()["runtime_agent_socket"]
    b = bundle(tmp_path, agent, "tenant=nobody-here", ["/usr/bin/python3", "-c", "print('ran')"])
    run_container(tmp_path, b, f"{tenant_prefix}x")
    refused = [json.loads(x) for x in daemon.log_path.read_text().splitlines() if x.startswith("{")]
    refused = [e for e in refused if e["event"] == "seccomp hand-over refused"]
    assert refused and "unknown tenant 'nobody-here'" in refused[-1]["reason"]
    assert daemon.proc.poll() is None


# ioctl(/dev/null, TCGETS): not an NVIDIA request, so allowed and answered by the 'driver' (ENOTTY);
# vmsplice with no segments: succeeds without seccomp, refused (EPERM) by the runtime default.
_PLAIN_IOCTL_AND_VMSPLICE = """
import ctypes, fcntl, os
fd = os.open('/dev/null', os.O_RDWR)
try:
    fcntl.ioctl(fd, 0x5401, bytearray(64))
except OSError as e:
    print(e.errno)
libc = ctypes.CDLL(None, use_errno=True)
print(0 if libc.syscall(278, 1, None, 0, 0) == 0 else ctypes.get_errno())
"""


def test_governed_container_keeps_the_runtime_default_refusals(daemon: Daemon, tenant_prefix: str, tmp_path: Path) -> None:
    assert SHIPPED["defaultAction"] == "SCMP_ACT_ERRNO"
    name = f"{tenant_prefix}def"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "1", check=True)
    agent = daemon.status()["runtime_agent_socket"]
    b = bundle(tmp_path, agent, f"tenant={name}", ["/usr/bin/python3", "-c", _PLAIN_IOCTL_AND_VMSPLICE])
    out = run_container(tmp_path, b, name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25", "1"], out.stdout  # other ioctls allowed; vmsplice refused as by the default


def test_an_argument_free_ioctl_allow_would_swallow_the_notify_rules(
    daemon: Daemon, tenant_prefix: str, tmp_path: Path
) -> None:
    """Why the generator takes ioctl out of the default's plain ALLOW rule: appended beside it, libseccomp
    drops the NOTIFY rules, and a second graphics session that the cap refuses goes through."""
    naive = json.loads(GENERATOR.DEFAULT.read_text())
    naive["syscalls"] += [GENERATOR._notify_rule(req, comment) for req, comment in GENERATOR.NOTIFIED_IOCTLS]
    name = f"{tenant_prefix}nv"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "1", check=True)
    agent = daemon.status()["runtime_agent_socket"]
    b = bundle(tmp_path, agent, f"tenant={name}",
               ["/usr/bin/python3", "/t/nv_ioctls.py", "alloc:0xCB97:1", "alloc:0xCB97:2"], profile=naive)
    out = run_container(tmp_path, b, name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25", "25"], out.stdout  # the cap of 1 never applied: the daemon never heard
    t = next(t for t in daemon.tenants() if t["name"] == name)
    assert not t.get("refusals")
