"""Shared fixtures: a real daemon on a temporary socket (root + real cgroups), and skip reasons that say why."""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from unisched.enforce.cgroups import CgroupDriver, CgroupError
from unisched.scheduler.config import runtime_agent_socket_beside
from unisched.telemetry import FakeTelemetry, GpuInfo
from unisched_wire.leasewire import lease_socket_beside

ROOT = Path(__file__).resolve().parent.parent
GOVERNED_DIR = Path(tempfile.gettempdir()) / f"us-governed-{os.getpid()}"
"""The test daemons' records of what they may freeze (enforce.governed): one directory per pytest run, so a test's
daemons never thaw what a daemon of another run (or the host's own) left frozen on purpose."""


def child_env() -> dict[str, str]:
    """The environment for child processes: this checkout first, whatever PYTHONPATH was set after it."""
    paths = [str(ROOT), str(ROOT / "clients"), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "UNISCHED_GOVERNED_DIR": str(GOVERNED_DIR)}


@functools.cache
def egl_reason() -> str | None:
    """Why the EGL examples (cloud_gaming's players, ad_sim's sim stage) cannot run here, None when they can:
    PyOpenGL, PyAV and numpy, and an EGL display that opens, a GPU's or Mesa's software rasterizer (llvmpipe), asked
    of cloud_gaming's own probe role."""
    for module in ("OpenGL", "av", "numpy"):
        if importlib.util.find_spec(module) is None:
            return f"{module} not installed (the test extra has it: pip install -e '.[test]')"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "cloud_gaming.py"), "--role", "probe"],
                       capture_output=True, text=True, timeout=120, env=child_env())
    return None if p.returncode == 0 else f"no EGL display opens here: {(p.stderr or p.stdout).strip()[-300:]}"


def subtree_for(prefix: str) -> str:
    """A test daemon's own cgroup subtree: it never touches a production daemon's tenants (or another test's)."""
    return f"unisched-test-{prefix}"


def freezer_unavailable_reason() -> str | None:
    """Why real cgroup tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create and freeze cgroups"
    try:
        from unisched.enforce.cgroups import CgroupError, detect_driver

        detect_driver("auto")
    except CgroupError as e:
        return f"no usable cgroup freezer: {e}"
    return None


needs_freezer = pytest.mark.skipif(freezer_unavailable_reason() is not None, reason=str(freezer_unavailable_reason()))


def cli(*args: str, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "unisched", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env=child_env(),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"unisched {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
    return proc


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes: a short directory in /tmp (kubelet plugin sockets)."""
    d = Path(tempfile.mkdtemp(prefix="k-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def telemetry() -> FakeTelemetry:
    """Two H200s, as the device plugin and DRA tests see a node."""
    return FakeTelemetry([GpuInfo(0, "H200", "GPU-0", 141 << 30), GpuInfo(1, "H200", "GPU-1", 141 << 30)])


def wait_until(predicate, timeout: float, what: str, poll: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll a real condition with a deadline (never a bare sleep standing in for the condition)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@dataclass
class Daemon:
    socket: str
    state_dir: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra: tuple[str, ...]
    prefix: str
    nvml: bool = False
    subtree: str = ""
    """This daemon's cgroup subtree (its --cgroup-subtree); subtree_for(prefix) when empty."""

    def __post_init__(self) -> None:
        self.subtree = self.subtree or subtree_for(self.prefix)

    @property
    def lease_socket(self) -> str:
        """The lease stream's socket: beside the main one (the daemon's default for a --socket of its own)."""
        return lease_socket_beside(self.socket)

    def cgroup(self, tenant: str) -> str:
        """Where this daemon creates `tenant`'s cgroup."""
        return f"/{self.subtree}/{tenant}"

    def cli(self, *args: str, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        return cli(*args[:1], "--socket", self.socket, *args[1:], timeout=timeout, check=check)

    def tenants(self) -> list[dict]:  # type: ignore[type-arg]
        return json.loads(self.cli("tenants", "--json", check=True).stdout)  # type: ignore[no-any-return]

    def status(self) -> dict:  # type: ignore[type-arg]
        return json.loads(self.cli("status", "--json", check=True).stdout)  # type: ignore[no-any-return]

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = self._spawn(log)
        wait_until(lambda: self.proc.poll() is not None or self.cli("status").returncode == 0, 20, "daemon to answer")
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited at start: {self.log_path.read_text()[-2000:]}")

    def argv(self) -> list[str]:
        """The daemon's command line."""
        return [sys.executable, "-m", "unisched", "serve", "--socket", self.socket, "--state-dir", self.state_dir,
                *(() if self.nvml else ("--no-nvml",)), "--log-format", "json", *self.extra]

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(), stdout=log, stderr=log, cwd=ROOT, env=child_env())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def cgroup_dir(self, tenant: str) -> Path:
        st = self.status()
        t = next(t for t in self.tenants() if t["name"] == tenant)
        return Path(str(st["cgroup_root"])) / str(t["cgroup"]).lstrip("/")


def _empty_and_remove(driver: CgroupDriver, cg: str) -> None:
    driver.set_frozen(cg, False)
    for pid in driver.pids(cg):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not driver.pids(cg), 10, f"{cg} to empty")
    wait_until(lambda: _removed(driver, cg), 10, f"{cg} to be removed")


def _removed(driver: CgroupDriver, cg: str) -> bool:
    """Remove `cg`; False while the kernel still counts it populated (EBUSY): on cgroup v2 a group whose last
    process was just killed can refuse rmdir for a moment after it lists no process (seen on the GPU machine)."""
    try:
        driver.remove(cg)
    except CgroupError as e:
        if "busy" not in str(e).lower():
            raise
        return False
    return True


def _cleanup_cgroups(prefix: str) -> None:
    """Every subtree named after the test, with all below it, in every hierarchy; and cgroups named after the test
    in the default subtree (tests that drive the cgroup driver directly)."""
    from unisched.enforce.cgroups import detect_driver

    default = detect_driver("auto")
    for cg in default.managed():
        if cg.rsplit("/", 1)[-1].startswith(prefix):
            _empty_and_remove(default, cg)
    mounts = {default.mount, getattr(default, "cpuacct", None) or default.mount}
    for top in sorted(p.name for p in default.mount.iterdir() if p.name.startswith(subtree_for(prefix))):
        driver = detect_driver("auto", top)
        for d, _, _ in sorted(os.walk(driver.mount / top), key=lambda w: -len(w[0])):  # deepest first
            _empty_and_remove(driver, "/" + str(Path(d).relative_to(driver.mount)))
        for mount in mounts:
            for d, _, _ in sorted(os.walk(mount / top), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(d)


@pytest.fixture
def tenant_prefix() -> str:
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture
def daemon_factory(tmp_path: Path, tenant_prefix: str) -> Iterator:  # type: ignore[type-arg]
    reason = freezer_unavailable_reason()
    if reason:
        pytest.skip(reason)
    started: list[Daemon] = []

    def make(*extra: str, nvml: bool = False, name: str = "") -> Daemon:
        """name: a second daemon of the test, with its own socket directory (so its own seccomp agent socket,
        which sits beside the main one), state, log and subtree."""
        sock_dir = Path(f"/tmp/us-{tenant_prefix}")
        sock_dir.mkdir(exist_ok=True)
        if name:
            sock_dir = sock_dir / name
            sock_dir.mkdir(exist_ok=True)
        subtree = f"{subtree_for(tenant_prefix)}{'-' + name if name else ''}"
        extra = ("--cgroup-subtree", subtree, *extra)
        d = Daemon(str(sock_dir / f"{name or 'd'}.sock"), str(tmp_path / f"{name}state"), None,  # type: ignore[arg-type]
                   tmp_path / f"{name or 'daemon'}.log", extra, tenant_prefix, nvml, subtree)
        d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        if d.proc.poll() is None:
            d.stop()
    _cleanup_cgroups(tenant_prefix)
    shutil.rmtree(f"/tmp/us-{tenant_prefix}", ignore_errors=True)
    # the runtime agent socket's directory beside it, which a daemon stopped by SIGKILL leaves behind
    shutil.rmtree(Path(runtime_agent_socket_beside(f"/tmp/us-{tenant_prefix}/d.sock")).parent, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> Daemon:  # type: ignore[no-untyped-def]
    return daemon_factory("--slice-ms", "20")  # type: ignore[no-any-return]


@contextlib.contextmanager
def pipe_listeners() -> Iterator[Callable[[], int]]:
    """A maker of stand-in seccomp listeners for the real hooks: each a pipe's read end whose writer stays open until
    the block ends (nothing to read, never hung up), so a supervisor serves it as it would a quiet listener."""
    writers: list[int] = []

    def listener() -> int:
        r, w = os.pipe()
        writers.append(w)
        return r

    try:
        yield listener
    finally:
        for w in writers:
            os.close(w)


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A fake API server's request handler that keeps its access log out of the test output."""

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def fake_api_server(handler: type[QuietHandler]) -> Iterator[str]:
    """A local HTTP server answering with `handler` (a fake Kubernetes API server) on a free port, in a thread, for
    the block; yields its URL."""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()
