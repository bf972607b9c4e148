"""The container path through containerd, as Kubernetes starts containers: a real containerd daemon (its own root,
state and socket in a temporary directory) starts containers with `ctr run --seccomp-profile`, whose profile
carries listenerPath (the daemon's runtime agent socket) and listenerMetadata (the tenant). containerd passes both
through to runc, runc hands the notification fd to the daemon, and the daemon admits and refuses sessions by the
tenant's caps, as under `unisched run` and tests/test_oci_agent.py (runc alone). /dev/null stands in for
/dev/nvidiactl (let through: ENOTTY 25; refused: EPERM 1).

containerd reads a profile as the OCI runtime-spec's seccomp section (contrib/seccomp.WithProfile, for ctr and for
the CRI plugin's Localhost profiles alike), so the containers here get deploy/seccomp/unisched-gpu.containerd-
amd64.json, the resolved form; the last test shows what the engine-format file would lose under containerd.
Needs root, containerd, ctr and runc (.ci/run installs Debian's containerd and runc)."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Daemon, wait_until
from test_oci_agent import _PLAIN_IOCTL_AND_VMSPLICE, make_rootfs

CONTAINERD, CTR, RUNC = shutil.which("containerd"), shutil.which("ctr"), shutil.which("runc")
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), "")
START_TIMEOUT_S = 30.0
"""containerd answers in well under a second; a loaded 2-core CI machine gets a generous deadline."""
RUN_TIMEOUT_S = 90.0
"""One `ctr run` of a short Python program (shim start, runc create, python3 start-up) on a loaded machine."""


def _reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run containerd"
    missing = [n for n, p in (("containerd", CONTAINERD), ("ctr", CTR), ("runc", RUNC)) if p is None]
    if missing:
        return f"{' and '.join(missing)} not installed (.ci/run installs Debian's containerd and runc)"
    if not ARCH:
        return f"no resolved containerd profile for {platform.machine()}"
    from unisched.enforce.seccomp.abi import probe

    return probe()


needs_containerd = pytest.mark.skipif(_reason() is not None, reason=str(_reason()))

SECCOMP = ROOT / "deploy" / "seccomp"
ENGINE_FORMAT = json.loads((SECCOMP / "unisched-gpu.json").read_text())
RESOLVED = json.loads((SECCOMP / f"unisched-gpu.containerd-{ARCH or 'amd64'}.json").read_text())

# kcmp(getpid(), getpid(), KCMP_FILE, 1, 1): the kernel allows it on one's own process without CAP_SYS_PTRACE
# (answer 0); the runtime default refuses it to containers without that capability (EPERM)
_KCMP = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
p = os.getpid()
print(0 if libc.syscall(312 if os.uname().machine == 'x86_64' else 272, p, p, 0, 1, 1) == 0 else ctypes.get_errno())
"""


@dataclass
class Containerd:
    """A containerd of the test's own: nothing outside its directory but the shim sockets (/run/containerd/s,
    removed with their tasks)."""

    dir: Path
    proc: subprocess.Popen[bytes]
    namespace: str

    @property
    def address(self) -> str:
        return str(self.dir / "c.sock")

    def ctr(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CTR, "--address", self.address, "--namespace", self.namespace, *args],  # type: ignore[list-item]
                              capture_output=True, text=True, timeout=timeout)

    def run(self, name: str, profile: dict[str, Any], args: list[str]) -> subprocess.CompletedProcess[str]:
        """`ctr run` a container from a local root (no image) with `profile` as its seccomp profile."""
        rootfs = self.dir / f"rootfs-{name}"
        make_rootfs(rootfs)
        path = self.dir / f"profile-{name}.json"
        path.write_text(json.dumps(profile))
        try:
            return self.ctr("run", "--rm", "--rootfs", "--runc-binary", str(RUNC), "--runc-root", str(self.dir / "runc"),
                            "--seccomp", "--seccomp-profile", str(path),
                            "--mount", "type=bind,src=/usr,dst=/usr,options=rbind:ro",
                            "--mount", f"type=bind,src={ROOT / 'tests'},dst=/t,options=rbind:ro",
                            str(rootfs), name, *args, timeout=RUN_TIMEOUT_S)
        finally:
            self.remove(name)

    def remove(self, name: str) -> None:
        """The task and container gone (a no-op after a `--rm` run that ended)."""
        self.ctr("task", "kill", "--signal", "SIGKILL", name)
        self.ctr("task", "delete", "--force", name)
        self.ctr("container", "delete", name)


def _config(d: Path) -> str:
    """containerd's config: everything under `d`, no CRI plugin (no kubelet here) and no snapshotters that
    probe the host's filesystems (containers run from a local root, not an image)."""
    disabled = ["io.containerd.grpc.v1.cri", *(f"io.containerd.snapshotter.v1.{s}" for s in
                                                ("btrfs", "zfs", "aufs", "devmapper"))]
    return "\n".join([
        "version = 2", f'root = "{d}/root"', f'state = "{d}/state"', f"disabled_plugins = {json.dumps(disabled)}",
        "[grpc]", f'  address = "{d}/c.sock"', "[ttrpc]", f'  address = "{d}/c.sock.ttrpc"',
        "[debug]", '  address = ""',
        '[plugins."io.containerd.internal.v1.opt"]', f'  path = "{d}/opt"', "",
    ])


def _unmount_under(d: Path) -> None:
    """Whatever containerd or runc left mounted under `d`, deepest first, so that rmtree cannot reach the host."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(f"{d}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


@pytest.fixture(scope="module")
def containerd() -> Iterator[Containerd]:
    d = Path(tempfile.mkdtemp(prefix="ctrd-"))  # short: socket paths stay under 108 bytes
    (d / "config.toml").write_text(_config(d))
    with open(d / "containerd.log", "wb") as log:
        proc = subprocess.Popen([CONTAINERD, "--config", str(d / "config.toml")],  # type: ignore[list-item]
                                stdout=log, stderr=log, start_new_session=True)
    c = Containerd(d, proc, f"unisched-test-{os.getpid()}")
    try:
        wait_until(lambda: proc.poll() is not None or c.ctr("version").returncode == 0, START_TIMEOUT_S,
                   "containerd to answer")
        assert proc.poll() is None, (d / "containerd.log").read_text()[-2000:]
        yield c
    finally:
        for name in c.ctr("container", "list", "--quiet").stdout.split() if proc.poll() is None else []:
            c.remove(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _unmount_under(d)
        shutil.rmtree(d, ignore_errors=True)
        _remove_namespace_cgroup(c.namespace)


def _remove_namespace_cgroup(namespace: str) -> None:
    """The cgroup that ctr made for the namespace's containers (runc removes theirs, not this parent), in cgroup v2's
    one hierarchy or each of v1's, so that no run leaves an empty cgroup behind."""
    fs = Path("/sys/fs/cgroup")
    for top in [fs / namespace, *fs.glob(f"*/{namespace}")]:
        wait_until(lambda top=top: _removed(top), 10, f"{top} to be removed")  # EBUSY a moment after the last exit


def _removed(cgroup: Path) -> bool:
    try:
        cgroup.rmdir()
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        return False
    return True


def governed(profile: dict[str, Any], agent: str, tenant: str) -> dict[str, Any]:
    """The profile pointed at the test daemon's runtime agent socket, naming the tenant as a root runtime may."""
    return {**profile, "listenerPath": agent, "listenerMetadata": f"tenant={tenant}"}


@needs_containerd
def test_containerd_passes_the_listener_through_and_the_daemon_governs_the_container(
    containerd: Containerd, daemon: Daemon, tenant_prefix: str
) -> None:
    name = f"{tenant_prefix}ctrd"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    daemon.cli("set-limit", "--tenant", name, "--render", "1", check=True)
    profile = governed(RESOLVED, daemon.status()["runtime_agent_socket"], name)
    out = containerd.run(name, profile, ["/usr/bin/python3", "/t/nv_ioctls.py",
                                         "alloc:0xCB97:1", "alloc:0xCB97:2", "alloc:0xB8B0:3"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25", "1", "25"], out.stdout  # graphics, refused second graphics, NVDEC
    t = next(t for t in daemon.tenants() if t["name"] == name)
    assert t["refusals"] == {"graphics": 1}
    events = [json.loads(x) for x in daemon.log_path.read_text().splitlines() if x.startswith("{")]
    assert any(e["event"] == "session hooks attached" and e["tenant"] == name for e in events)


@needs_containerd
def test_listener_path_reaches_runc(containerd: Containerd, tmp_path: Path) -> None:
    """containerd keeps listenerPath (runtime-spec >= 1.0.2-dev of March 2021, containerd >= 1.5.5): runc tries
    the path it names, and refuses to start the container when nothing listens there."""
    missing = str(tmp_path / "nobody-listens.sock")
    out = containerd.run("nolistener", {**RESOLVED, "listenerPath": missing}, ["/usr/bin/true"])
    assert out.returncode != 0
    assert "seccomp agent" in out.stderr and missing in out.stderr, out.stderr


@needs_containerd
def test_unknown_tenant_in_metadata_is_refused(containerd: Containerd, daemon: Daemon, tenant_prefix: str) -> None:
    profile = governed(RESOLVED, daemon.status()["runtime_agent_socket"], "nobody-here")
    containerd.run(f"{tenant_prefix}x", profile, ["/usr/bin/python3", "-c", "print('ran')"])
    events = [json.loads(x) for x in daemon.log_path.read_text().splitlines() if x.startswith("{")]
    refused = [e for e in events if e["event"] == "seccomp hand-over refused"]
    assert refused and "unknown tenant 'nobody-here'" in refused[-1]["reason"]
    assert daemon.proc.poll() is None


@needs_containerd
def test_governed_container_keeps_the_runtime_default_refusals(
    containerd: Containerd, daemon: Daemon, tenant_prefix: str
) -> None:
    """Other ioctls are answered by the 'driver'; vmsplice (refused for everyone) and kcmp (refused without
    CAP_SYS_PTRACE) are refused as by the runtime default."""
    name = f"{tenant_prefix}def"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    profile = governed(RESOLVED, daemon.status()["runtime_agent_socket"], name)
    out = containerd.run(name, profile, ["/usr/bin/python3", "-c", _PLAIN_IOCTL_AND_VMSPLICE + _KCMP])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["25", "1", "1"], out.stdout


@needs_containerd
def test_engine_format_profile_loses_the_capability_rules_under_containerd(
    containerd: Containerd, daemon: Daemon, tenant_prefix: str
) -> None:
    """Why containerd gets its own file: handed the engine-format profile, containerd drops includes/excludes
    unread, the ALLOW rule meant for containers with CAP_SYS_PTRACE applies to all, and kcmp goes through."""
    assert any("kcmp" in r["names"] and r.get("includes") for r in ENGINE_FORMAT["syscalls"])
    name = f"{tenant_prefix}eng"
    assert daemon.cli("run", "--tenant", name, "--keep", "--", "true").returncode == 0
    profile = governed(ENGINE_FORMAT, daemon.status()["runtime_agent_socket"], name)
    out = containerd.run(name, profile, ["/usr/bin/python3", "-c", _KCMP])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"], out.stdout


def test_the_containerd_profile_is_the_engine_profile_resolved_for_containerd_s_default_capabilities() -> None:
    from test_oci_agent import GENERATOR

    resolved = GENERATOR.to_oci(ENGINE_FORMAT, set(GENERATOR.CONTAINERD_DEFAULT_CAPS), ARCH or "amd64")
    assert resolved == RESOLVED
    assert "archMap" not in RESOLVED and not any(r.get("includes") or r.get("excludes") for r in RESOLVED["syscalls"])
    assert RESOLVED["listenerPath"] == ENGINE_FORMAT["listenerPath"]

