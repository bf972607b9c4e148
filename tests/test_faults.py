"""The daemon under faults: real daemon subprocesses, real cgroups, real processes, except where the
fault is NVML's (no GPU here: a stub NVML module and fake telemetry drive the real engine code).

Waits poll real conditions with deadlines (wait_until); the fixed sleeps are measurement windows or, in the
SIGKILL loop, the random kill points themselves."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Daemon, child_env, subtree_for, wait_until
from structlog.testing import capture_logs
from test_daemon_cgroups import cpu_seconds, frozen, measure, start_tenant, stays_thawed, wait_registered
from test_engine import SLICE, Rig

from unisched.policy import Engine, Priority
from unisched.scheduler.state import SavedTenant, StateStore
from unisched.telemetry import FakeTelemetry, GpuInfo, GpuSample
from unisched.telemetry.nvml import NvmlTelemetry, open_nvml
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb


def events(d: Daemon, since: int = 0) -> list[dict[str, Any]]:
    """The daemon's JSON log lines from byte offset `since`."""
    with open(d.log_path, "rb") as f:
        f.seek(since)
        lines = f.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def start_fast(d: Daemon, nofile: int | None = None) -> None:
    """Daemon.start, polling in-process rather than with the CLI (restart loops do many), optionally with the
    daemon's open-file limit (soft and hard) set to `nofile`."""
    args = ["serve", "--socket", d.socket, "--state-dir", d.state_dir, "--no-nvml", "--log-format", "json", *d.extra]
    limit = "" if nofile is None else f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
    boot = f"import os, resource, sys; {limit}os.execv(sys.executable, [sys.executable, '-m', 'unisched', *sys.argv[1:]])"
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([sys.executable, "-c", boot, *args], stdout=log, stderr=log, cwd=ROOT, env=child_env())

    def up() -> bool:
        if d.proc.poll() is not None:
            return True
        try:
            with DaemonClient(d.socket, timeout=2) as c:
                c.status()
        except DaemonError:
            return False
        return True

    wait_until(up, 20, "the daemon to answer", poll=0.02)
    assert d.proc.poll() is None, f"daemon exited at start: {d.log_path.read_text()[-2000:]}"


def log_size(d: Daemon) -> int:
    return d.log_path.stat().st_size if d.log_path.exists() else 0


def assert_clean_log(d: Daemon, since: int = 0) -> None:
    text = d.log_path.read_bytes()[since:].decode(errors="replace")
    assert "Traceback" not in text, text[text.index("Traceback") - 500 :][:3000]
    bad = [e for e in events(d, since) if e.get("event") in ("slice failed; thawing everything and going on",)]
    assert not bad, bad


def kill_cgroup(cg_dir: Path) -> None:
    """SIGKILL everything in a cgroup, thawing it as we go (the v1 freezer holds signals while frozen)."""

    def empty() -> bool:
        pids = [int(p) for p in (cg_dir / "cgroup.procs").read_text().split()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if (cg_dir / "cgroup.freeze").exists():
                (cg_dir / "cgroup.freeze").write_text("0")
            else:
                (cg_dir / "freezer.state").write_text("THAWED")
        return not pids

    wait_until(empty, 10, f"{cg_dir} to empty")


# --- HTTP/2 by hand: clients that misbehave below gRPC --------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x8


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


CONCURRENT_STREAMS = 100
"""The streams one HTTP/2 connection to the daemon may have open at once (h2's default, in its SETTINGS)."""


def h2_hello(big_window: bool = False) -> bytes:
    """Preface, our SETTINGS and the ACK of the server's; with big_window the server may send ~2 GiB unread."""
    settings = struct.pack(">HI", 0x4, 2**31 - 1) if big_window else b""
    out = PREFACE + h2_frame(SETTINGS, 0, 0, settings) + h2_frame(SETTINGS, 0x1, 0)
    if big_window:
        out += h2_frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535))
    return out


def grpc_request(stream: int, method: str, message: bytes = b"") -> bytes:
    def literal(name: bytes, value: bytes) -> bytes:  # HPACK: literal header field without indexing, new name
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    headers = b"".join(
        literal(n, v)
        for n, v in [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/unisched.v1.Unisched/{method}".encode()),
            (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        ]
    )
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    return h2_frame(HEADERS, 0x4, stream, headers) + h2_frame(DATA, 0x1, stream, body)


def first_reply(buf: bytes, stream: int = 1) -> bytes | None:
    """The gRPC message in the first DATA frame of `stream`, once `buf` holds it."""
    while len(buf) >= 9:
        n = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + n:
            return None
        kind, sid, payload = buf[3], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9 : 9 + n]
        if kind == DATA and sid == stream and len(payload) >= 5:
            return payload[5 : 5 + int.from_bytes(payload[1:5], "big")]
        buf = buf[9 + n :]
    return None


@contextlib.contextmanager
def open_files_limit(soft: int, hard: int) -> Iterator[None]:
    """RLIMIT_NOFILE for this process (and so for a daemon it starts meanwhile); restored after."""
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


def connect_many(path: str, n: int, payload: bytes) -> list[socket.socket | None]:
    """n clients at once (64 threads): connect, send `payload`. None where the daemon hung up before we sent."""

    def one(_: int) -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)  # blocking: waits in the kernel's backlog like a patient client
            s.sendall(payload)
        except OSError:
            s.close()
            return None
        return s

    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(one, range(n)))


def collect_replies(socks: list[socket.socket], timeout: float) -> tuple[dict[socket.socket, bytes], set[socket.socket]]:
    """Read each socket until its first reply (served) or EOF/reset (refused)."""
    sel = selectors.DefaultSelector()
    bufs = {s: b"" for s in socks}
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    served: dict[socket.socket, bytes] = {}
    refused: set[socket.socket] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(served) + len(refused) < len(socks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{len(socks) - len(served) - len(refused)} clients got neither a reply nor a hang-up")
            for key, _ in sel.select(min(left, 1.0)):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    refused.add(s)
                    sel.unregister(s)
                    continue
                bufs[s] += chunk
                msg = first_reply(bufs[s])
                if msg is not None:
                    served[s] = msg
                    sel.unregister(s)
    finally:
        sel.close()
    return served, refused


def tenants(d: Daemon) -> dict[str, pb.Tenant]:
    """The daemon's tenants by name, asked in-process (a CLI call costs a Python start)."""
    with DaemonClient(d.socket, timeout=10) as c:
        return {t.name: t for t in c.tenants()}


def timed_status(d: Daemon) -> float:
    t0 = time.monotonic()
    with DaemonClient(d.socket, timeout=10) as c:
        c.status()
    return time.monotonic() - t0


def answers_promptly(d: Daemon) -> bool:
    """Status answered within a second (False, not an error, while the daemon still refuses or is slow)."""
    try:
        return timed_status(d) < 1.0
    except DaemonError:
        return False


# --- a tenant forks many short-lived children ----------------------------------------------------------
@pytest.mark.root
def test_fork_storm_while_another_tenant_contends(daemon: Daemon, tenant_prefix: str) -> None:
    storm_t, busy_t = f"{tenant_prefix}fork", f"{tenant_prefix}busy"
    busy = start_tenant(daemon, busy_t, 100, "--seconds", "40")
    dirs = wait_registered(daemon, [busy_t])
    storm = subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", storm_t, "--weight", "200",
         "--keep", "--", "sh", "-c", 'i=0; while [ $i -lt 500 ]; do /bin/true; i=$((i+1)); done; echo "forked $i"'],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, text=True,
    )
    latencies, states = [], set()
    busy_before = cpu_seconds(dirs[busy_t])
    try:
        deadline = time.monotonic() + 60
        with DaemonClient(daemon.socket, timeout=10) as c:
            while storm.poll() is None:
                assert time.monotonic() < deadline, "the fork storm did not finish in 60 s"
                t0 = time.monotonic()
                c.status()
                shown = {t.name: t for t in c.tenants()}
                latencies.append(time.monotonic() - t0)
                states |= {(n, t.state) for n, t in shown.items()}
        out, _ = storm.communicate(timeout=10)
        assert storm.returncode == 0 and "forked 500" in out
        assert max(latencies) < 1.0, f"the daemon answered slowly during the storm: max {max(latencies):.2f} s"
        assert {(storm_t, "frozen"), (busy_t, "frozen")} & states, f"the two tenants never contended: {states}"
        assert cpu_seconds(dirs[busy_t]) > busy_before, "the contending tenant made no progress"
        shown_now = tenants(daemon)
        assert shown_now[storm_t].base_weight == 200 and shown_now[busy_t].base_weight == 100
        assert shown_now[busy_t].pids, "the contending tenant lost its processes"
        assert not [e for e in events(daemon) if e["event"].startswith("tenant cgroup lost")]
        assert_clean_log(daemon)
        storm_dir = dirs[busy_t].parent / storm_t
        daemon.stop(signal.SIGTERM)
        assert not frozen(storm_dir) and not frozen(dirs[busy_t]), "a cgroup was left frozen after stop"
    finally:
        busy.kill()
        busy.wait(timeout=10)


# --- a tenant process is stopped, then killed, mid-slice -------------------------------------------------
@pytest.mark.root
def test_stopped_then_killed_tenant(daemon: Daemon, tenant_prefix: str) -> None:
    a, b = f"{tenant_prefix}stop", f"{tenant_prefix}other"
    procs = {a: start_tenant(daemon, a, 100, "--seconds", "40"), b: start_tenant(daemon, b, 100, "--seconds", "40")}
    try:
        dirs = wait_registered(daemon, [a, b])

        def hog_of(name: str) -> int:
            pids = wait_until(lambda: [int(p) for p in (dirs[name] / "cgroup.procs").read_text().split()
                                       if int(p) != procs[name].pid], 10, f"{name}'s hog")
            return int(pids[0])

        def state(name: str) -> str:
            return str(tenants(daemon)[name].state)

        hog_a = hog_of(a)
        wait_until(lambda: state(a) == "frozen" or state(b) == "frozen", 10, "the two to contend")
        os.kill(hog_a, signal.SIGSTOP)
        wait_until(lambda: state(a) == "idle", 10, "the stopped tenant to count as idle")
        wait_until(lambda: not frozen(dirs[b]), 10, "the other tenant to be thawed")
        assert stays_thawed(dirs[b], 1.5), "the other tenant did not get the stopped one's share: still sliced"
        os.kill(hog_a, signal.SIGCONT)
        wait_until(lambda: state(a) in ("running", "frozen"), 10, "the continued tenant to show work again")
        measure(dirs, 0.5)  # settle
        both = measure(dirs, 1.5)
        assert 0.3 <= both[a] / (both[a] + both[b]) <= 0.7, f"shares after SIGCONT: {both}"
        os.kill(hog_a, signal.SIGKILL)  # wherever the slice is; if frozen, it dies when next thawed
        assert procs[a].wait(timeout=20) == 128 + signal.SIGKILL
        wait_until(lambda: state(a) == "idle", 10, "the killed tenant to become idle")
        wait_until(lambda: not frozen(dirs[b]), 10, "the other tenant to be thawed")
        assert stays_thawed(dirs[b], 1.5), "the other tenant did not get the killed one's share: still sliced"
        shown = tenants(daemon)
        assert list(shown[a].pids) == [] and shown[a].base_weight == 100
        assert_clean_log(daemon)
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


# --- clients that never read, send garbage, or hold connections silently -----------------------------------
@pytest.mark.root
def test_clients_that_never_read_or_send_garbage(daemon_factory, tenant_prefix: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    names = [f"{tenant_prefix}s{i:02d}" for i in range(40)]  # big ListTenants replies pile up faster
    subtree = subtree_for(tenant_prefix)
    StateStore(tmp_path / "state").save([
        SavedTenant(n, 100 + i, Priority.OFFLINE, frozenset({Engine.COMPUTE}), None, f"/{subtree}/{n}", False, 0)
        for i, n in enumerate(names)
    ])
    d = daemon_factory("--slice-ms", "20")
    socks: list[socket.socket] = []
    sender = threading.Thread()

    def raw() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks.append(s)
        s.connect(d.socket)
        return s

    try:
        # 1. asks for as many tenant lists at once as the daemon allows (h2's 100 concurrent streams, which it
        # advertises; more is a protocol error that ends the connection) with a 2 GiB window, and never reads a
        # byte of the answers
        hog = raw()
        hog.sendall(h2_hello(big_window=True))
        def ask() -> None:
            with contextlib.suppress(OSError):
                hog.sendall(b"".join(grpc_request(2 * i + 1, "ListTenants") for i in range(CONCURRENT_STREAMS)))

        sender = threading.Thread(target=ask, daemon=True)
        sender.start()

        def unread() -> int:
            return int(struct.unpack("i", fcntl.ioctl(hog.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])

        wait_until(lambda: unread() > 100_000, 20, "answers to pile up unread")
        # 2. silent connections; 3. garbage instead of HTTP/2; 4. a valid preface then garbage frames;
        # 5. a frame header promising 16 MB that never come
        silent = [raw() for _ in range(20)]
        for s, junk in [
            (raw(), random.Random(1).randbytes(200_000)),
            (raw(), h2_hello() + random.Random(2).randbytes(5000)),
            (raw(), h2_hello() + (16 * 2**20 - 1).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01"),
        ]:
            s.settimeout(5)
            with contextlib.suppress(OSError):
                s.sendall(junk)
        # everyone else is still served promptly
        latencies = [timed_status(d) for _ in range(20)]
        assert max(latencies) < 1.0, f"status took up to {max(latencies):.2f} s"
        with DaemonClient(d.socket, timeout=10) as c:
            assert sorted(t.name for t in c.tenants()) == names
        fresh = raw()
        fresh.sendall(h2_hello() + grpc_request(1, "Status"))
        served, _ = collect_replies([fresh], 10)
        assert pb.StatusReply.FromString(served[fresh]).caller_pid == os.getpid()
        assert unread() > 100_000 and d.proc.poll() is None
        assert len(silent) == 20
    finally:
        if socks:
            with contextlib.suppress(OSError):
                socks[0].shutdown(socket.SHUT_RDWR)  # wakes the sender if it is still blocked
        if sender.is_alive():
            sender.join(10)
        for s in socks:
            s.close()
    wait_until(lambda: answers_promptly(d), 10, "status after the bad clients left")
    assert_clean_log(d)


# --- 1000 clients at once ------------------------------------------------------------------------------------
def need_descriptors(n: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"1000 connections need a hard open-file limit of {n}; this host's is {hard}")


@pytest.mark.root
def test_a_thousand_clients_at_once(daemon_factory, tenant_prefix: str) -> None:  # type: ignore[no-untyped-def]
    need_descriptors(4096)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with open_files_limit(max(soft, min(hard, 16384)), hard):  # 1000 connections: 2 descriptors each in the daemon
        d = daemon_factory("--slice-ms", "20")
        t0 = time.monotonic()
        socks = connect_many(d.socket, 1000, h2_hello() + grpc_request(1, "Status"))
        try:
            assert all(s is not None for s in socks), "clients were hung up on below the connection limit"
            live = [s for s in socks if s is not None]
            served, refused = collect_replies(live, 30)
            elapsed = time.monotonic() - t0
            assert not refused and len(served) == 1000
            assert {pb.StatusReply.FromString(m).caller_pid for m in served.values()} == {os.getpid()}
            # while all 1000 are connected, real gRPC calls are answered
            assert timed_status(d) < 2.0
            with DaemonClient(d.socket, timeout=10) as c:
                assert c.tenants() == []
        finally:
            for s in socks:
                if s is not None:
                    s.close()
        assert elapsed < 30
        wait_until(lambda: answers_promptly(d), 10, "status after the clients left")
        assert d.proc.poll() is None
        assert_clean_log(d)


@pytest.mark.root
def test_connections_past_the_limit_are_refused_cleanly(daemon_factory, tenant_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """With 1024 descriptors the daemon can hold ~384 connections; the rest must be hung up on at once. Before,
    asyncio accepted the whole backlog, hit EMFILE, logged it hundreds of thousands of times and stalled ~60 s."""
    need_descriptors(2048)  # for this process's 1000 sockets
    d = daemon_factory("--slice-ms", "20")
    d.stop()
    start_fast(d, nofile=1024)
    since = log_size(d)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with open_files_limit(max(soft, min(hard, 4096)), hard):
        t0 = time.monotonic()
        socks = connect_many(d.socket, 1000, h2_hello() + grpc_request(1, "Status"))
        try:
            live = [s for s in socks if s is not None]
            served, refused = collect_replies(live, 20)
            elapsed = time.monotonic() - t0
        finally:
            for s in socks:
                if s is not None:
                    s.close()
    hung_up = len(refused) + sum(1 for s in socks if s is None)
    assert len(served) + hung_up == 1000
    assert 100 <= len(served) < 1000 and hung_up > 0, (len(served), hung_up)
    assert elapsed < 20, f"deciding on 1000 clients took {elapsed:.1f} s"
    wait_until(lambda: answers_promptly(d), 10, "status once the clients left")
    evs = events(d, since)
    refusals = [e for e in evs if e["event"] == "too many connections; refusing"]
    assert refusals and len(refusals) < 50, f"{len(refusals)} refusal log lines"
    text = d.log_path.read_bytes()[since:].decode(errors="replace")
    assert "Too many open files" not in text and "out of file descriptors" not in text
    assert_clean_log(d, since)


# --- a managed cgroup removed underneath the daemon ----------------------------------------------------------
@pytest.mark.root
def test_cgroup_removed_underneath_is_recreated_by_run(daemon: Daemon, tenant_prefix: str) -> None:
    gone, other = f"{tenant_prefix}gone", f"{tenant_prefix}stays"
    procs = [start_tenant(daemon, gone, 100, "--seconds", "40"), start_tenant(daemon, other, 100, "--seconds", "40")]
    try:
        dirs = wait_registered(daemon, [gone, other])
        # an admin or a container runtime kills everything in it and removes it
        kill_cgroup(dirs[gone])
        wait_until(lambda: procs[0].poll() is not None, 10, "the killed tenant's run to exit")

        wait_until(lambda: rmdir(dirs[gone]), 10, "the cgroup to be removable")
        acct = Path(str(dirs[gone]).replace("/freezer/", "/cpuacct/"))
        if acct != dirs[gone]:  # cgroup v1: its cpuacct twin goes too
            wait_until(lambda: rmdir(acct), 10, "the cpuacct cgroup to be removable")
        wait_until(lambda: [e for e in events(daemon) if e["event"].startswith("tenant cgroup lost") and e["tenant"] == gone],
                   10, "the daemon to log the lost cgroup")
        # the whole share: never frozen again (its CPU rate would say the same on an idle host, not on a loaded one)
        wait_until(lambda: not frozen(dirs[other]), 10, "the remaining tenant to be thawed")
        assert stays_thawed(dirs[other], 1.5), "the remaining tenant was still sliced"
        shown = tenants(daemon)
        assert shown[other].state == "running" and shown[other].target_share == pytest.approx(1.0)
        assert shown[gone].state == "idle" and list(shown[gone].pids) == [] and shown[gone].base_weight == 100
        # `unisched run` into it later recreates the cgroup and runs there
        out = daemon.cli("run", "--tenant", gone, "--keep", "--", "cat", "/proc/self/cgroup", check=True)
        assert f"{daemon.cgroup(gone)}\n" in out.stdout
        assert dirs[gone].is_dir()
        assert [e for e in events(daemon) if e["event"] == "tenant cgroup recreated" and e["tenant"] == gone]
        # and it is sliced again like any tenant
        procs.append(start_tenant(daemon, gone, 100, "--seconds", "20"))
        wait_until(lambda: tenants(daemon)[gone].state == "frozen", 10, "the recreated tenant to be sliced again")
        assert_clean_log(daemon)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


# --- NVML errors mid-run ---------------------------------------------------------------------------------------
class FlakyTelemetry(FakeTelemetry):
    """FakeTelemetry that can raise (a telemetry must not, but the slice loop must survive one that does)."""

    def __init__(self) -> None:
        super().__init__([GpuInfo(0, "NVIDIA H200", "GPU-0", 1 << 30)])
        self.error: Exception | None = None

    def sample(self) -> Any:
        if self.error is not None:
            raise self.error
        return super().sample()


def test_engine_slices_on_when_telemetry_fails(tmp_path: Path) -> None:
    tel = FlakyTelemetry()
    rig = Rig(tmp_path, telemetry=tel)
    rig.add("a", 300)
    rig.add("b", 100)

    def phase(steps: int) -> tuple[float, float]:
        a0, b0, g0 = rig.cpu("a"), rig.cpu("b"), sum(s.gpu_seconds for s in rig.engine.snapshots())
        rig.step(steps)
        return (rig.cpu("a") - a0) / (rig.cpu("b") - b0), sum(s.gpu_seconds for s in rig.engine.snapshots()) - g0

    tel.next_samples = [GpuSample(0, 0.9, 0.0, 0.0, 0)]
    _, gpu_s = phase(200)
    assert gpu_s == pytest.approx(0.9 * 200 * SLICE, rel=0.05)
    with capture_logs() as logs:
        tel.error = RuntimeError("NVML: GPU is lost (Xid 79)")
        ratio, _ = phase(400)  # tick() must not raise
        assert ratio == pytest.approx(3.0, rel=0.1), "without a GPU signal the CPU stand-in must keep the weights"
        tel.error = None
        tel.next_samples = [GpuSample(0, 0.0, 0.0, 0.0, 0, ok=False)]  # a telemetry that says the GPU is unknown
        ratio, _ = phase(400)
        assert ratio == pytest.approx(3.0, rel=0.1)
        tel.next_samples = [GpuSample(0, 0.9, 0.0, 0.0, 0)]
        ratio, gpu_s = phase(400)
    assert ratio == pytest.approx(3.0, rel=0.1)
    assert gpu_s == pytest.approx(0.9 * 400 * SLICE, rel=0.05), "GPU charging did not resume"
    said = [e["event"] for e in logs if "telemetry" in e["event"]]
    assert said == ["telemetry failed; slicing on CPU signals until it recovers", "telemetry recovered"]


class StubNvml(types.SimpleNamespace):
    """Enough of pynvml for NvmlTelemetry: two H200s; `fail[gpu]` makes every call on that GPU raise."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):  # pynvml's names
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_GpuIsLost(NVMLError):
        pass

    class NVMLError_Unknown(NVMLError):  # what an Xid often surfaces as
        pass

    NVML_GPU_UTILIZATION_SAMPLES = 1

    def __init__(self) -> None:
        super().__init__()
        self.fail: dict[int, Exception] = {}
        self.count_error: Exception | None = None
        self.ts = 0

    def _check(self, h: int) -> None:
        if h in self.fail:
            raise self.fail[h]

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check(i)
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._check(h)
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._check(h)
        return types.SimpleNamespace(total=141 << 30, used=(1 + h) << 30)

    def nvmlDeviceGetSamples(self, h: int, kind: int, since: int) -> Any:
        self._check(h)
        self.ts += 1000
        return kind, [types.SimpleNamespace(timeStamp=self.ts, sampleValue=types.SimpleNamespace(uiVal=60))]

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._check(h)
        return types.SimpleNamespace(gpu=60)

    def nvmlDeviceGetDecoderUtilization(self, h: int) -> tuple[int, int]:
        self._check(h)
        return 10, 167000

    def nvmlDeviceGetEncoderUtilization(self, h: int) -> tuple[int, int]:
        raise self.NVMLError_NotSupported("no NVENC")

    def nvmlDeviceGetEncoderSessions(self, h: int) -> list[Any]:
        raise self.NVMLError_NotSupported("no NVENC")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list[Any]:
        self._check(h)
        return []

    def nvmlInit(self) -> None:
        return None

    def nvmlShutdown(self) -> None:
        return None


def test_nvml_errors_give_unknown_samples_and_recover() -> None:
    nvml = StubNvml()
    tel = NvmlTelemetry(nvml)
    assert [(s.index, s.ok, s.sm_util) for s in tel.sample()] == [(0, True, 0.6), (1, True, 0.6)]
    with capture_logs() as logs:
        for error in (StubNvml.NVMLError_GpuIsLost("GPU is lost"), StubNvml.NVMLError_Unknown("Unknown Error"),
                      RuntimeError("a binding that raises something else")):
            nvml.fail[1] = error
            for _ in range(3):
                got = tel.sample()  # must not raise
                assert [(s.index, s.ok) for s in got] == [(0, True), (1, False)]
                assert got[1].sm_util == 0.0 and got[0].sm_util == 0.6
        del nvml.fail[1]
        got = tel.sample()
    assert [(s.index, s.ok, s.sm_util, s.memory_used) for s in got] == [(0, True, 0.6, 1 << 30), (1, True, 0.6, 2 << 30)]
    said = [(e["event"], e.get("gpu")) for e in logs]
    assert said == [("nvml error, GPU treated as unknown", 1), ("nvml recovered", 1)], said


def test_nvml_lists_the_pids_with_a_gpu_context_or_says_it_cannot() -> None:
    nvml = StubNvml()
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: [types.SimpleNamespace(pid=41, usedGpuMemory=None)]  # type: ignore[method-assign]
    assert [s.gpu_pids for s in NvmlTelemetry(nvml).sample()] == [frozenset({41})] * 2  # listed, memory unknown

    def refuse(h: int) -> list[Any]:
        raise StubNvml.NVMLError_NotSupported("not in this VM")
    nvml.nvmlDeviceGetGraphicsRunningProcesses = refuse  # type: ignore[method-assign]
    assert [s.gpu_pids for s in NvmlTelemetry(nvml).sample()] == [None, None]  # one list failed: unknown


def test_nvml_gpu_lost_before_start(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = StubNvml()
    nvml.fail[0] = StubNvml.NVMLError_GpuIsLost("GPU is lost")
    tel = NvmlTelemetry(nvml)  # the daemon starts with the GPU that is left
    assert [g.index for g in tel.gpus()] == [1]
    assert [(s.index, s.ok) for s in tel.sample()] == [(1, True)]
    broken = StubNvml()
    broken.count_error = StubNvml.NVMLError_Unknown("Unknown Error")
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert open_nvml() is None  # CPU signals instead of a daemon that does not start


def test_engine_with_nvml_losing_a_gpu_mid_run(tmp_path: Path) -> None:
    nvml = StubNvml()
    rig = Rig(tmp_path, telemetry=NvmlTelemetry(nvml))
    rig.add("a", 300)
    rig.add("b", 100)
    rig.step(50)
    nvml.fail[0] = StubNvml.NVMLError_GpuIsLost("GPU is lost")
    nvml.fail[1] = StubNvml.NVMLError_Unknown("Xid 13")
    a0, b0 = rig.cpu("a"), rig.cpu("b")
    rig.step(400)
    assert (rig.cpu("a") - a0) / (rig.cpu("b") - b0) == pytest.approx(3.0, rel=0.1)
    nvml.fail.clear()
    rig.step(50)
    assert all(s.ok for s in rig.engine.gpu_samples())


# --- the state file is truncated or corrupt before start ------------------------------------------------------
@pytest.mark.root
def test_corrupt_state_file_is_kept_aside_and_the_daemon_serves(daemon: Daemon, tenant_prefix: str) -> None:
    tenant = f"{tenant_prefix}keep"
    daemon.cli("run", "--tenant", tenant, "--weight", "250", "--keep", "--", "true", check=True)
    root_dir = Path(daemon.status()["cgroup_root"])
    escaped = root_dir / f"{tenant_prefix}escaped"
    daemon.stop()
    state = Path(daemon.state_dir) / "state.json"
    good = state.read_bytes()
    assert [(t.name, t.weight) for t in StateStore(daemon.state_dir, daemon.subtree).load()] == [(tenant, 250)]
    damages = {
        "truncated": good[: len(good) // 2],
        "garbage": random.Random(3).randbytes(300),
        "wrong types": json.dumps({"version": 1, "tenants": [{"name": tenant, "weight": "heavy"}]}).encode(),
        "escaping cgroup": json.dumps({"version": 1, "tenants": [{
            "name": tenant, "weight": 100, "priority": "offline", "engines": ["compute"], "gpus": None,
            "cgroup": f"/{escaped.name}", "adopted": False, "owner_uid": 0,
        }]}).encode(),
    }
    try:
        for what, body in damages.items():
            state.write_bytes(body)
            since = log_size(daemon)
            start_fast(daemon)  # restarts within a second of each other: the copies must not overwrite each other
            said = [e for e in events(daemon, since) if e["event"].startswith("state file unreadable")]
            assert said, f"{what}: the daemon did not say the state file was unreadable"
            assert Path(said[0]["copy"]).read_bytes() == body, f"{what}: the copy is not the damaged file"
            assert not escaped.exists(), "a corrupt file made the daemon create a cgroup outside /unisched"
            with DaemonClient(daemon.socket, timeout=10) as c:
                assert c.status().tenants == 0, f"{what}: tenants restored from a damaged file"
                c.adopt(pb.AdoptRequest(tenant=tenant, weight=250, cgroup=daemon.cgroup(tenant)))  # it serves
            assert [(t.name, t.weight) for t in StateStore(daemon.state_dir, daemon.subtree).load()] == [(tenant, 250)]
            assert_clean_log(daemon, since)
            daemon.stop()
        copies = sorted(Path(daemon.state_dir).glob("state.json.corrupt-*"))
        assert len(copies) == len(damages), f"copies overwrote each other: {copies}"
    finally:
        with contextlib.suppress(OSError):
            escaped.rmdir()


# --- SIGKILL at random points, restart, repeat -----------------------------------------------------------------
@pytest.mark.root
def test_sigkill_at_random_points_then_restart(daemon: Daemon, tenant_prefix: str) -> None:
    from unisched.enforce.cgroups import detect_driver

    rng = random.Random(6)
    a, b = f"{tenant_prefix}k1", f"{tenant_prefix}k3"
    procs = [start_tenant(daemon, a, 100, "--seconds", "60"), start_tenant(daemon, b, 300, "--seconds", "60")]
    driver = detect_driver("auto")
    cgroups = [daemon.cgroup(a), daemon.cgroup(b)]
    try:
        dirs = wait_registered(daemon, [a, b])
        wait_until(lambda: any(t.state == "frozen" for t in tenants(daemon).values()), 10, "the two to contend")
        caught_frozen = 0
        for i in range(8):
            time.sleep(rng.uniform(0.0, 0.3))  # the kill point itself (seeded), not a wait for a condition
            daemon.stop(signal.SIGKILL)
            left = [cg for cg in cgroups if driver.is_frozen(cg)]
            caught_frozen += bool(left)
            if not left:  # killed between slices: freeze one so that the restart has work either way
                left = [rng.choice(cgroups)]
                driver.set_frozen(left[0], True)
            since = log_size(daemon)
            start_fast(daemon)
            thawed = [e for e in events(daemon, since) if e["event"] == "thawed cgroups left frozen by a previous run"]
            assert thawed, f"iteration {i}: the new daemon did not thaw {left}"
            assert set(left) <= set(thawed[0]["cgroups"]), f"iteration {i}: thawed {thawed[0]['cgroups']}, left {left}"
            known = {n: t.base_weight for n, t in tenants(daemon).items()}
            assert known == {a: 100, b: 300}, f"iteration {i}: tenants after restart {known}"
        assert caught_frozen >= 1, "no kill ever landed while a tenant was frozen"
        rates = measure(dirs, 1.5)
        assert min(rates.values()) > 0.1, f"a tenant made no progress after the restarts: {rates}"
        assert_clean_log(daemon)
        daemon.stop(signal.SIGTERM)
        assert not any(driver.is_frozen(cg) for cg in cgroups), "SIGTERM left a cgroup frozen"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
