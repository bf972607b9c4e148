"""Running under systemd: sd_notify (READY, STATUS, WATCHDOG) to a real datagram socket posing as
NOTIFY_SOCKET, from a real daemon; log priorities for journald; `install-service`; `serve --delegated` on real
cgroups."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Daemon, child_env, cli, freezer_unavailable_reason, wait_until
from structlog.testing import capture_logs

from unisched.scheduler.runner import LateSlices, run_engine
from unisched.sdnotify import Notifier, Watchdog, watchdog_interval_s


class NotifySocket:
    """What systemd listens on: a datagram socket; each message is KEY=VALUE lines."""

    def __init__(self, name: str, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + name.encode() if abstract else name)
        self.env = "@" + name if abstract else name

    def receive(self, timeout: float) -> tuple[float, dict[str, str]] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return time.monotonic(), dict(line.split("=", 1) for line in data.decode().splitlines())

    def wait_for(self, key: str, timeout: float) -> tuple[float, dict[str, str]]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            got = self.receive(left)
            if got is not None and key in got[1]:
                return got
        raise AssertionError(f"no {key} within {timeout:.0f} s")


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def notify(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    s = NotifySocket(str(tmp_path / "notify") if not request.param else f"unisched-test-{uuid.uuid4().hex}", request.param)
    monkeypatch.setenv("NOTIFY_SOCKET", s.env)
    yield s
    s.sock.close()


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        try:
            c.connect(path)
        except OSError:
            return False
    return True


def test_ready_is_sent_once_the_socket_answers(daemon_factory: Any, notify: NotifySocket) -> None:
    d: Daemon = daemon_factory("--slice-ms", "20")
    _, msg = notify.wait_for("READY", 20)
    assert msg["READY"] == "1" and msg["MAINPID"] == str(d.proc.pid)
    assert d.socket in msg["STATUS"]
    assert _answers(d.socket)
    d.stop()
    _, msg = notify.wait_for("STOPPING", 20)
    assert msg["STOPPING"] == "1" and "thawing" in msg["STATUS"]


def test_watchdog_pings_come_from_the_slice_loop_at_half_the_timeout(
    daemon_factory: Any, notify: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # WatchdogSec=0.4s: a ping every 0.2 s
    daemon_factory("--slice-ms", "20")
    notify.wait_for("WATCHDOG", 20)
    while notify.receive(0.01) is not None:
        pass  # what queued while the daemon started arrives at once: time only pings received as sent
    times = [notify.wait_for("WATCHDOG", 20)[0] for _ in range(8)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # never faster than half of WATCHDOG_USEC, by the mean: a ping received late (this process woken late on a
    # loaded host) makes its gap longer and the next one shorter, though both were sent on time
    assert (times[-1] - times[0]) / len(gaps) >= 0.18, gaps
    assert statistics.median(gaps) < 0.4, gaps  # and well inside the timeout


def test_no_watchdog_pings_without_watchdog_usec(daemon_factory: Any, notify: NotifySocket) -> None:
    daemon_factory("--slice-ms", "20")
    notify.wait_for("READY", 20)
    assert notify.receive(1.0) is None


# --- pure logic ---------------------------------------------------------------------------------------------


def test_watchdog_interval_follows_watchdog_usec_and_pid() -> None:
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "7"}, pid=7) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "8"}, pid=7) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


def test_watchdog_pings_at_most_once_per_interval() -> None:
    sent: list[dict[str, str | int]] = []

    class Recorder(Notifier):
        def send(self, wait_s: float = 0.0, **fields: str | int) -> bool:
            sent.append(fields)
            return True

    now = [0.0]
    dog = Watchdog(Recorder("x"), 15.0, lambda: "ok", clock=lambda: now[0])
    for t in (0.0, 1.0, 14.9, 15.0, 20.0, 30.1):
        now[0] = t
        dog.alive()
    assert sent == [{"WATCHDOG": 1, "STATUS": "ok"}] * 3  # at 0, 15 and 30.1


def test_notifier_without_notify_socket_does_nothing() -> None:
    assert Notifier.from_env({}).ready("x") is False


def test_a_full_notify_queue_drops_a_ping_instead_of_blocking_the_loop(tmp_path: Path) -> None:
    """Any local process can fill PID 1's notify socket: the watchdog's ping (sent from the event loop) must not wait
    for room."""
    import threading

    path = str(tmp_path / "notify")
    unread = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unread.bind(path)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    with unread, filler:
        try:
            while True:
                filler.sendto(b"x" * 64, path)
        except BlockingIOError:
            pass  # the queue is full
        notifier, returned = Notifier(path), []
        t = threading.Thread(target=lambda: returned.append(notifier.send(WATCHDOG=1)), daemon=True)
        t.start()
        t.join(5.0)
        notifier.close()
    assert returned == [False], "the ping waited for room in a full queue"


class _Engine:
    """Stands in for Scheduler in the loop: ticks that fail or succeed."""

    def __init__(self, fail: bool, stop: asyncio.Event) -> None:
        self.fail, self.stop, self.ticks = fail, stop, 0
        self.config = type("C", (), {"slice_ms": 1})()
        self.sweeps_slack = False

    def tick(self) -> float:
        self.ticks += 1
        if self.ticks >= 5:
            self.stop.set()
        if self.fail:
            raise RuntimeError("slice failed")
        return 0.0

    def advance(self, readings: object = None) -> float:
        """What the loop calls (a tick at each slice boundary)."""
        return self.tick()

    def tick_due(self) -> bool:
        return False  # every call ticks on reads of its own (none here)

    def thaw_all(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("fail", [False, True])
def test_the_loop_reports_alive_only_after_a_slice_ran(fail: bool) -> None:
    calls: list[int] = []

    async def go() -> int:
        stop = asyncio.Event()
        engine = _Engine(fail, stop)
        await run_engine(engine, stop, lambda: calls.append(engine.ticks))  # type: ignore[arg-type]
        return engine.ticks

    ticks = asyncio.run(go())
    assert calls == ([] if fail else list(range(1, ticks + 1)))


def test_the_loop_waits_for_its_slices_without_a_task_each() -> None:
    """A lease renewal due while the loop turns waits behind it: a wait per slice that makes a task and, at its
    timeout, cancels it and waits for that costs some five loop turns a slice; one waiter serves the whole run."""
    made: list[object] = []

    async def go() -> None:
        loop = asyncio.get_running_loop()

        def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
            made.append(coro)
            return asyncio.Task(coro, loop=loop, **kw)

        loop.set_task_factory(factory)
        stop = asyncio.Event()
        engine = _Engine(False, stop)
        engine.ticks = -15  # 20 slices
        await run_engine(engine, stop)
        loop.set_task_factory(None)

    asyncio.run(go())
    assert len(made) == 1


def test_a_slice_that_starts_late_is_logged_once_per_interval() -> None:
    """Slices asked after 0 s that start 0.01, 0.5, 0.3, 11 and 0.2 s later: 0.5 s is logged; 0.3 s, within the
    interval, is held back; 11 s is logged and says one was held back; 0.2 s is held back again."""
    t = [100.0]
    late = LateSlices(lambda: t[0])
    assert late.check() is None  # no slice asked yet
    seen = []
    with capture_logs() as logs:
        for wait_s in (0.01, 0.5, 0.3, 11.0, 0.2):
            late.expect(0.0)
            t[0] += wait_s
            seen.append(late.check())
    assert seen == [None, pytest.approx(0.5), None, pytest.approx(11.0), None]
    assert [(e["late_ms"], e["earlier_late_slices_not_logged"]) for e in logs] == [(500.0, 0), (11000.0, 1)]
    assert {e["log_level"] for e in logs} == {"warning"}


# --- journald: syslog priority prefixes -----------------------------------------------------------------------

_LOG_EACH_LEVEL = """
import structlog
from unisched.logs import configure_logging
configure_logging("json", "debug")
log = structlog.get_logger("t")
log.debug("d"); log.info("i"); log.warning("w"); log.error("e"); log.critical("c")
try:
    1 / 0
except ZeroDivisionError:
    log.exception("x")
"""


def _log_lines(tmp_path: Path, journal: bool) -> list[str]:
    out = tmp_path / "stderr"
    with open(out, "wb") as f:
        st = os.fstat(f.fileno())
        other = os.stat(tmp_path)
        stream = f"{st.st_dev}:{st.st_ino}" if journal else f"{other.st_dev}:{other.st_ino}"
        subprocess.run([sys.executable, "-c", _LOG_EACH_LEVEL], stderr=f, check=True, cwd=ROOT,
                       env={**child_env(), "JOURNAL_STREAM": stream})
    return out.read_text().splitlines()


def test_log_lines_carry_their_syslog_priority_when_stderr_is_the_journal(tmp_path: Path) -> None:
    lines = _log_lines(tmp_path, journal=True)
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>", "<2>", "<3>"]
    events = [json.loads(line[3:]) for line in lines]
    assert [e["event"] for e in events] == ["d", "i", "w", "e", "c", "x"]
    assert "ZeroDivisionError" in events[-1]["exception"]


def test_no_prefix_when_journal_stream_names_another_file(tmp_path: Path) -> None:
    """An inherited $JOURNAL_STREAM with stderr redirected elsewhere: plain JSON lines, as before."""
    lines = _log_lines(tmp_path, journal=False)
    assert len(lines) == 6 and all(line.startswith("{") for line in lines)


def test_daemon_log_lines_are_prefixed_under_the_journal(
    daemon_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "daemon.log"  # the file daemon_factory's daemon writes stderr to (opened for append)
    log.touch()
    st = log.stat()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    daemon_factory("--slice-ms", "20")
    serving = [line for line in log.read_text().splitlines() if '"serving"' in line]
    assert serving and serving[0].startswith("<6>{"), serving


# --- install-service: ExecStart for this interpreter ----------------------------------------------------------


def _unit_service(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
        elif line and not line.startswith("#") and section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_install_service_writes_a_unit_that_runs_this_interpreter(tmp_path: Path) -> None:
    unit = tmp_path / "unisched.service"
    config = tmp_path / "unisched.toml"
    config.write_text((ROOT / "deploy" / "unisched.toml").read_text())
    done = cli("install-service", "--unit-path", str(unit), "--config", str(config))
    assert done.returncode == 0, done.stderr
    svc = _unit_service(unit)
    (exec_start,) = svc["ExecStart"]
    argv = shlex.split(exec_start)
    assert argv == [sys.executable, "-m", "unisched", "serve", "--config", str(config), "--delegated"]
    env = dict(shlex.split(e)[0].split("=", 1) for e in svc["Environment"])
    assert env["PYTHONPATH"] == f"{ROOT}:{ROOT / 'clients'}"  # where this unisched and its wire package were imported from
    assert svc["ProtectHome"] == (["read-only"] if sys.executable.startswith(("/root/", "/home/")) else ["yes"])
    # the unit's command finds unisched in an empty environment, as systemd starts it (serve -> --help: no daemon)
    ran = subprocess.run([*argv[:4], "--help"], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    assert ran.returncode == 0 and "--delegated" in ran.stdout, ran.stderr
    if shutil.which("systemd-analyze"):
        verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        assert verify.returncode == 0 and not verify.stderr.strip(), verify.stderr


def test_install_service_writes_the_config_where_there_is_none_and_leaves_one_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the README's install steps say: a fresh host gets a config the daemon starts with (before, only a hint was
    printed, and the enabled unit exited 2 on the missing file)."""
    from unisched.cli.service import install_service
    from unisched.scheduler.config import load_config

    monkeypatch.chdir(tmp_path)
    said = install_service(str(tmp_path / "unit" / "unisched.service"), "etc/unisched.toml")  # relative: made absolute
    config = tmp_path / "etc" / "unisched.toml"
    assert config.read_text() == (ROOT / "deploy" / "unisched.toml").read_text() and f"wrote {config}" in said
    assert oct(config.stat().st_mode & 0o777) == "0o644"
    assert load_config(config).socket == "/run/unisched/unisched.sock"
    assert f"--config {config} --delegated" in (tmp_path / "unit" / "unisched.service").read_text()
    config.write_text("[policy]\nslice_ms = 40\n")  # the operator's own: never replaced
    install_service(str(tmp_path / "unit" / "unisched.service"), str(config))
    assert config.read_text() == "[policy]\nslice_ms = 40\n"
    with pytest.raises(OSError, match="is a directory"):
        install_service(str(tmp_path / "unit"), str(config))
    assert sorted(p.name for p in tmp_path.rglob(".*.tmp")) == []


def test_install_service_quotes_paths_and_doubles_percent() -> None:
    from unisched.cli.service import Install, render_unit, unit_template

    text = render_unit(unit_template(), Install("/opt/my venv/bin/python", "/opt/50%/site", "/etc/u.toml"))
    assert 'ExecStart="/opt/my venv/bin/python" -m unisched serve --config /etc/u.toml --delegated' in text
    assert "Environment=PYTHONPATH=/opt/50%%/site" in text
    with pytest.raises(ValueError, match="cannot be written"):
        render_unit(unit_template(), Install('/opt/"x"/python', "/s", "/c"))


# --- Delegate=yes: the daemon in a leaf of its own subtree -----------------------------------------------------


def _unit_hierarchy() -> tuple[str, Path]:
    from unisched.enforce.cgroups import detect_driver

    driver = detect_driver("auto")
    if driver.kind == "v2":
        return "v2", driver.mount
    systemd = next((Path(f[1]) for f in (line.split() for line in Path("/proc/self/mounts").read_text().splitlines())
                    if f[2] == "cgroup" and "name=systemd" in f[3].split(",")), None)
    if systemd is None:
        pytest.skip("cgroup v1 without a name=systemd hierarchy: no unit cgroup to stand in for")
    return "v1", systemd


def _cgroup_line(pid: int, kind: str) -> str:
    wanted = "" if kind == "v2" else "freezer"
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == wanted or (kind == "v1" and wanted in ctrl.split(",")):
            return path
    raise AssertionError(f"no {wanted!r} line for {pid}")


def test_delegated_daemon_moves_itself_into_a_leaf_of_its_unit_cgroup(tmp_path: Path, tenant_prefix: str) -> None:
    if (reason := freezer_unavailable_reason()) is not None:
        pytest.skip(reason)
    from unisched.enforce.cgroups import detect_driver

    kind, hierarchy = _unit_hierarchy()
    driver = detect_driver("auto")
    unit = hierarchy / f"{tenant_prefix}.service"  # stands in for /system.slice/unisched.service
    unit.mkdir()
    sock = f"/tmp/us-{tenant_prefix}/d.sock"
    Path(sock).parent.mkdir()
    log = tmp_path / "daemon.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "unisched", "serve", "--socket", sock, "--state-dir", str(tmp_path / "state"),
                 "--no-nvml", "--log-format", "json", "--delegated"],
                stdout=out, stderr=out, cwd=ROOT, env=child_env(),
                preexec_fn=lambda: (unit / "cgroup.procs").write_text("0"),  # started by systemd in its unit cgroup
            )
        p = proc
        wait_until(lambda: p.poll() is not None or cli("status", "--socket", sock).returncode == 0, 30, "daemon to answer")
        assert proc.poll() is None, log.read_text()
        assert _cgroup_line(proc.pid, kind) == f"/{tenant_prefix}.service/daemon"
        if kind == "v2":
            assert (unit / "cgroup.procs").read_text() == ""  # the unit cgroup itself holds no process: v2 allows children
        delegated = next(json.loads(x) for x in log.read_text().splitlines() if '"delegated"' in x)
        assert delegated["tenants_subtree"] == f"{tenant_prefix}.service/tenants"
        assert delegated["daemon_cgroup"] == f"/{tenant_prefix}.service/daemon" or kind == "v1"
        out = cli("run", "--socket", sock, "--tenant", f"{tenant_prefix}d", "--", "cat", "/proc/self/cgroup")
        assert f":/{tenant_prefix}.service/tenants/{tenant_prefix}d\n" in out.stdout, out  # tenants in the unit's subtree
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=20)
        for base in {hierarchy, driver.mount, *_v1_cpuacct()}:
            top = base / f"{tenant_prefix}.service"
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if top.is_dir() else ():
                d.rmdir()  # the tenants' subtree and the daemon's leaf, deepest first
            if top.is_dir():
                top.rmdir()
        shutil.rmtree(Path(sock).parent, ignore_errors=True)


def _v1_cpuacct() -> list[Path]:
    """The v1 cpuacct hierarchy, where the v1 driver also makes tenant cgroups (none on a v2 host)."""
    lines = Path("/proc/self/mounts").read_text().splitlines()
    return [Path(f.split()[1]) for f in lines if f.split()[2] == "cgroup" and "cpuacct" in f.split()[3]]


def test_delegated_refuses_the_root_cgroup(tmp_path: Path) -> None:
    if (reason := freezer_unavailable_reason()) is not None:
        pytest.skip(reason)
    kind, _ = _unit_hierarchy()
    from unisched.enforce.delegate import DelegationError, unit_cgroup

    with pytest.raises(DelegationError, match="root cgroup"):
        unit_cgroup("0::/\n", "v2")
    assert unit_cgroup("0::/system.slice/unisched.service/daemon\n", "v2") == "/system.slice/unisched.service"
    assert unit_cgroup("12:freezer:/\n1:name=systemd:/system.slice/u.service\n0::/\n", "v1") == "/system.slice/u.service"
    if _cgroup_line(os.getpid(), kind) in ("/", ""):
        done = cli("serve", "--socket", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path), "--no-nvml", "--delegated")
        assert done.returncode == 1 and "root cgroup" in done.stderr, done.stderr
