"""Session hooks carried across a graceful restart through systemd's fd store (transport/carry.py): a stand-in for
systemd's notify socket that keeps the fds it is sent, a real seccomp listener, real daemons and `unisched run`."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import json
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from conftest import ROOT, Daemon, child_env
from test_seccomp import CHILD, ENOSYS, ENOTTY, EPERM, GRAPHICS, NVDEC, Proc, needs_notify, running_tenant, wait_for

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.nvclasses import SessionKind
from unisched.enforce.seccomp.hooks import FakeSessionHooks, KeptListener
from unisched.enforce.seccomp.supervisor import SessionSupervisor
from unisched.policy.callers import Pod
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig, DeclaredTenant
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.sdnotify import Notifier, passed_fds
from unisched.telemetry import NoGpuTelemetry
from unisched.transport.agent import SeccompAgentServer
from unisched.transport.carry import CARRIED_FILE, FD_NAME_PREFIX, Carried, ListenerCarry, _parse, is_seccomp_listener
from unisched.transport.identity import CONTAINED_ROOT


class FdStore:
    """What systemd's notify socket does with FDSTORE=1 and FDSTOREREMOVE=1: keeps the fds sent under their FDNAME,
    closes them when told to remove that name. A thread reads it as messages come (as PID 1 does: the queue holds
    only a few datagrams); `wait` waits for what a test expects to have arrived."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.env = str(path)
        self.fds: dict[str, int] = {}
        self.removed: list[str] = []
        self.messages: list[dict[str, str]] = []
        self._notifiers: list[Notifier] = []
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            ready = select.select([self.sock, self._stop_r], [], [])[0]
            if self._stop_r in ready:
                return
            self._one()

    def _one(self) -> None:
        fds = array.array("i")
        msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(64 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
        name = fields.get("FDNAME", "stored")
        with self._lock:
            self.messages.append(fields)
            if fields.get("FDSTORE") == "1":
                for fd in fds:
                    self.fds[name] = fd
            else:
                for fd in fds:
                    os.close(fd)
            if fields.get("FDSTOREREMOVE") == "1":
                self.removed.append(name)
                if name in self.fds:
                    os.close(self.fds.pop(name))

    def wait(self, done: Callable[[FdStore], bool], what: str) -> None:
        wait_for(lambda: self._check(done), what)

    def _check(self, done: Callable[[FdStore], bool]) -> bool:
        with self._lock:
            return done(self)

    def notifier(self) -> Notifier:
        """A daemon's side of this socket (closed with the store)."""
        self._notifiers.append(Notifier(self.env))
        return self._notifiers[-1]

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._reader.join(10)
        for fd in (*self.fds.values(), self._stop_r, self._stop_w):
            os.close(fd)
        for n in self._notifiers:
            n.close()
        self.sock.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FdStore]:
    s = FdStore(tmp_path / "notify")
    yield s
    s.close()


@contextlib.contextmanager
def systemd_start(passed: Sequence[tuple[int, str]], argv: list[str]) -> Iterator[tuple[list[str], list[int], dict[str, str]]]:
    """`argv` started as systemd starts a service it passes fds to: each of `passed` at 3, 4, ... with LISTEN_FDS,
    LISTEN_FDNAMES and LISTEN_PID (set by a wrapper that then execs `argv`, keeping its pid). Yields the command, the
    fds to pass to it (copies at 200 and up, so that no move clobbers another; closed after the block) and its
    environment."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 200 + i) for i, (fd, _) in enumerate(passed)]
    wrapper = ("import os, sys; n = int(sys.argv[1]); src = [int(a) for a in sys.argv[2:2 + n]]\n"
               "for i, fd in enumerate(src):\n    os.dup2(fd, 3 + i); os.close(fd)\n"
               "os.environ['LISTEN_PID'] = str(os.getpid()); os.execv(sys.argv[2 + n], sys.argv[2 + n:])")
    env = child_env()
    if passed:
        env |= {"LISTEN_FDS": str(len(passed)), "LISTEN_FDNAMES": ":".join(n for _, n in passed)}
    try:
        yield [sys.executable, "-c", wrapper, str(len(high)), *map(str, high), *argv], high, env
    finally:
        for fd in high:
            os.close(fd)


# --- the pieces -------------------------------------------------------------------------------------------------------
def test_passed_fds_are_this_process_s_only_and_the_variables_go() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x"}
    assert passed_fds(env, pid=2) == [] and env == {}  # another process's: not ours, and not handed down either
    assert passed_fds({"LISTEN_PID": "7", "LISTEN_FDS": "99999999"}, pid=7) == []  # a count no systemd passes
    assert passed_fds({"LISTEN_PID": "seven", "LISTEN_FDS": "1"}, pid=7) == []


def test_passed_fds_names_each_fd_from_three_on(tmp_path: Path) -> None:
    """In a child whose fds 3 and 4 are what systemd would pass: both found, named, and close-on-exec after."""
    code = ("import json, os, sys; from unisched.sdnotify import passed_fds; "
            "got = passed_fds(); print(json.dumps([got, [os.get_inheritable(fd) for fd, _ in got], "
            "'LISTEN_FDS' in os.environ]))")
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    with systemd_start([(r1, "first"), (r2, "second")], [sys.executable, "-c", code]) as (cmd, fds, env):
        out = subprocess.run(cmd, pass_fds=fds, env=env, capture_output=True, text=True, timeout=30, cwd=ROOT)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    assert out.returncode == 0, out.stderr
    got, inheritable, left = json.loads(out.stdout)
    assert got == [[3, "first"], [4, "second"]] and inheritable == [False, False] and not left


def test_store_fd_sends_the_fd_under_its_name_and_remove_drops_it(store: FdStore) -> None:
    notifier = store.notifier()
    r, w = os.pipe()
    try:
        assert notifier.store_fd(r, "unisched-hook-a-0")
        store.wait(lambda st: "unisched-hook-a-0" in st.fds, "the fd in the store")
        os.write(w, b"x")
        assert os.read(store.fds["unisched-hook-a-0"], 1) == b"x"  # the very pipe
        assert notifier.remove_stored("unisched-hook-a-0")
        store.wait(lambda st: st.removed == ["unisched-hook-a-0"] and not st.fds, "the fd dropped")
    finally:
        os.close(r)
        os.close(w)


def _carry(store: FdStore, state: Path, passed: list[tuple[int, str]] | None = None,
           env: dict[str, str] | None = None) -> ListenerCarry:
    return ListenerCarry(store.notifier(), state, env=env or {}, passed=(lambda: list(passed or [])))


class _listener:
    """A real seccomp listener of a tenant process (test_seccomp's helper), as (fd, process); the fd is closed at
    the end unless `release`d (to a supervisor, or as what systemd passes)."""

    def __enter__(self) -> tuple[int, Proc]:
        self._it = running_tenant()
        self._proc, self._fd = next(self._it)
        return self._fd, self._proc

    def release(self) -> int:
        fd, self._fd = self._fd, -1
        return fd

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        next(self._it, None)


CGROUPS: dict[str, str] = {t: f"/sys/fs/cgroup/unisched/{t}" for t in ("alpha", "beta", "gamma")}
"""Each tenant's cgroup at the stop (the daemon's `cgroup_of`); delta is gone."""


@needs_notify
def test_keep_lists_then_stores_each_listener_and_take_serves_only_the_listed(store: FdStore, tmp_path: Path) -> None:
    """A stop lists, then stores, each listener (a runtime's first); the next start serves the listed listeners, and
    closes a listener no list names (its tenant's calls then fail at once) and a listed name that is no listener;
    systemd is asked to drop every stored copy; the list is read once."""
    users, runtime, stray, dropped = _listener(), _listener(), _listener(), _listener()
    with users as (a, _), runtime as (b, _), stray as (_, stray_proc), dropped as (_, dropped_proc):
        carry = _carry(store, tmp_path)
        kept = [KeptListener(os.dup(a), "alpha", 1000), KeptListener(os.dup(b), "beta", 0),
                KeptListener(dropped.release(), "delta", 0)]
        assert carry.keep(kept, CGROUPS.get) == 2  # delta's tenant is gone by the stop: not kept
        assert dropped_proc.call(f"alloc {NVDEC:#x} 0x1") == ENOSYS  # but closed, as every fd handed to keep
        store.wait(lambda st: len(st.fds) == 2, "both listeners in the store")
        listed = json.loads((tmp_path / CARRIED_FILE).read_text())["listeners"]
        assert [(e["tenant"], e["uid"], e["cgroup"]) for e in listed] == [  # the runtime's first
            ("beta", 0, CGROUPS["beta"]), ("alpha", 1000, CGROUPS["alpha"])]
        assert sorted(store.fds) == sorted(e["name"] for e in listed)
        pipe_r, pipe_w = os.pipe()
        other_r, other_w = os.pipe()
        passed = [(os.dup(fd), n) for n, fd in store.fds.items()]
        passed += [(stray.release(), FD_NAME_PREFIX + "zz-0"), (other_r, "something-else")]
        listed_pipe = _carry(store, tmp_path)  # a listed name whose fd is not a listener: a second stop's list
        assert listed_pipe.keep([KeptListener(pipe_r, "gamma", 0)], CGROUPS.get) == 1
        pipe_name = json.loads((tmp_path / CARRIED_FILE).read_text())["listeners"][0]["name"]
        both = [*listed, {"name": pipe_name, "tenant": "gamma", "uid": 0, "cgroup": CGROUPS["gamma"]}]
        (tmp_path / CARRIED_FILE).write_text(json.dumps({"listeners": both}))
        os.chmod(tmp_path / CARRIED_FILE, 0o600)
        store.wait(lambda st: pipe_name in st.fds, "the pipe in the store")
        passed.append((os.dup(store.fds[pipe_name]), pipe_name))
        taken = _carry(store, tmp_path, passed).take()
        assert sorted((c.tenant, c.user, c.cgroup) for _, c in taken) == [
            ("alpha", 1000, CGROUPS["alpha"]), ("beta", 0, CGROUPS["beta"])]
        assert all(is_seccomp_listener(fd) for fd, _ in taken)
        assert not (tmp_path / CARRIED_FILE).exists()  # read once: a later start never serves these again
        assert stray_proc.call(f"alloc {NVDEC:#x} 0x1") == ENOSYS  # the unlisted listener's last copy was closed
        os.write(other_w, b"x")  # not ours: left alone
        names = [e["name"] for e in listed]
        store.wait(lambda st: sorted(st.removed) == sorted([*names, FD_NAME_PREFIX + "zz-0", pipe_name]),
                   "every stored copy dropped")
        assert not store.fds
        with pytest.raises(BrokenPipeError):
            os.write(pipe_w, b"x")  # listed, but no listener: closed too (every copy)
        for fd, _ in taken:
            os.close(fd)
        for fd in (pipe_w, other_r, other_w):
            os.close(fd)


@needs_notify
@pytest.mark.parametrize("listed", ["nothing", "damaged", "no cgroup"])
def test_without_a_list_nothing_is_carried(store: FdStore, tmp_path: Path, listed: str) -> None:
    """After a crash there is no list (or a damaged one, or one whose entry does not say the tenant's cgroup): a
    stored listener, whose received calls nobody may ever answer, is closed, and dropped from the store: its tenant's
    next call fails at once."""
    if listed == "damaged":
        (tmp_path / CARRIED_FILE).write_text('{"listeners": [{"name": "unisched-hook-0a-0", "tenant": ')
    elif listed == "no cgroup":
        (tmp_path / CARRIED_FILE).write_text(json.dumps(
            {"listeners": [{"name": FD_NAME_PREFIX + "0a-0", "tenant": "alpha", "uid": 0}]}))
        os.chmod(tmp_path / CARRIED_FILE, 0o600)
    held = _listener()
    with held as (_, proc):
        assert _carry(store, tmp_path, [(held.release(), FD_NAME_PREFIX + "0a-0")]).take() == []
        assert proc.call(f"alloc {NVDEC:#x} 0x1") == ENOSYS
        store.wait(lambda st: st.removed == [FD_NAME_PREFIX + "0a-0"], "the stored copy dropped")
        assert not (tmp_path / CARRIED_FILE).exists()


def test_a_carried_listener_is_served_only_for_its_tenant_over_the_same_cgroup(tmp_path: Path) -> None:
    """A tenant of the listed name over another cgroup (the configuration changed between stop and start) is not
    the one whose processes hold the listener: that listener is closed, as one whose tenant is gone."""
    config = DaemonConfig(tenants=(DeclaredTenant(name="render"), DeclaredTenant(name="other")))
    engine = Scheduler(config, FakeCgroupDriver(), NoGpuTelemetry(), StateStore(tmp_path / "state"), FakeClock())
    engine.start()
    cgroup = {t.name: t.cgroup for t in engine.snapshots()}
    hooks = FakeSessionHooks()
    pipes = [os.pipe() for _ in range(3)]  # read ends stand in for the listeners
    carried = [(pipes[0][0], Carried(FD_NAME_PREFIX + "0a-0", "render", Pod(7), cgroup["render"])),
               (pipes[1][0], Carried(FD_NAME_PREFIX + "0a-1", "other", 0, cgroup["render"])),
               (pipes[2][0], Carried(FD_NAME_PREFIX + "0a-2", "nobody", 0, cgroup["render"]))]
    server = SeccompAgentServer(str(tmp_path / "agent.sock"), engine, hooks=hooks, carried=carried)

    async def start_and_close() -> None:
        await server.start()
        await server.close()

    asyncio.run(start_and_close())
    assert hooks.attached == ["render"]
    assert hooks.users == [Pod(7)], "served again as the pod that handed it over, within that pod's bounds"
    for _, w in pipes:  # the served one is the hooks' (the fake closes it), the others closed
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
        os.close(w)


def test_the_list_says_who_handed_each_listener_over_a_uid_or_a_pod() -> None:
    """A pod's listener is listed as its pod's (the pid namespace outlives the restart), so after the restart it
    still counts against that pod's per-user bounds, not against the uid its process ran as; an entry that names
    both, neither or no real namespace is not believed."""
    cgroup = CGROUPS["alpha"]
    entries = [Carried(FD_NAME_PREFIX + f"0a-{i}", "alpha", user, cgroup)
               for i, user in enumerate([0, 1000, CONTAINED_ROOT, Pod(4026532999)])]
    listed = [e.listed() for e in entries]
    assert listed[3] == {"name": FD_NAME_PREFIX + "0a-3", "tenant": "alpha", "pod": 4026532999, "cgroup": cgroup}
    bad = [{**listed[3], "uid": 1000}, {**listed[3], "pod": 0}, {**listed[3], "pod": True}, {**listed[1], "uid": -5},
           {k: v for k, v in listed[3].items() if k != "pod"}]
    bad = [{**b, "name": FD_NAME_PREFIX + f"0b-{i}"} for i, b in enumerate(bad)]
    assert list(_parse(json.dumps({"listeners": listed + bad}).encode()).values()) == entries


@needs_notify
def test_a_list_others_could_write_is_not_believed(store: FdStore, tmp_path: Path) -> None:
    held = _listener()
    with held as (fd, proc):
        carry = _carry(store, tmp_path)
        assert carry.keep([KeptListener(os.dup(fd), "alpha", 0)], CGROUPS.get) == 1
        store.wait(lambda st: len(st.fds) == 1, "the listener in the store")
        os.chmod(tmp_path / CARRIED_FILE, 0o622)
        (name,) = store.fds
        assert _carry(store, tmp_path, [(os.dup(store.fds[name]), name)]).take() == []
        os.close(held.release())
        store.wait(lambda st: not st.fds, "the stored copy dropped")
        assert proc.call(f"alloc {NVDEC:#x} 0x1") == ENOSYS


@needs_notify
def test_keep_stores_no_more_than_the_store_has_room_for(store: FdStore, tmp_path: Path) -> None:
    with _listener() as (a, _):
        carry = _carry(store, tmp_path, env={"FDSTORE": "1"})
        assert carry.keep([KeptListener(os.dup(a), "alpha", 0), KeptListener(os.dup(a), "beta", 0)], CGROUPS.get) == 1
        store.wait(lambda st: len(st.fds) == 1, "one listener in the store")
        assert [e["tenant"] for e in json.loads((tmp_path / CARRIED_FILE).read_text())["listeners"]] == ["alpha"]


@needs_notify
def test_a_kept_listener_answers_what_it_received_and_waits_for_the_next_server() -> None:
    """close(keep=True) while a new session's decision is still on the (here: never running) loop: past its wait for
    the decision the call is admitted (not ENOSYS), the listener stays open, and the next supervisor of it answers
    the tenant's next call."""
    loop = asyncio.new_event_loop()
    held = _listener()
    try:
        with held as (_, proc):
            sup = SessionSupervisor(held.release(), "t", lambda *_: False, keep_decision_s=0.05)
            sup.attach(loop)
            proc.send(f"alloc {GRAPHICS:#x} 0x1")
            wait_for(lambda: sup.stats().pending == 1, "the session call to wait for the loop")
            sup.close(keep=True)
            assert proc.line() == f"ok {ENOTTY}"  # admitted: it went on to the (stand-in) driver
            kept = sup.take_kept()
            assert kept is not None and sup.take_kept() is None
            proc.send(f"alloc {NVDEC:#x} 0x2")
            assert proc.popen.stdout is not None
            assert not select.select([proc.popen.stdout], [], [], 0.2)[0], "the call should wait for the next server"
            nxt = SessionSupervisor(kept, "t", lambda *_: False)
            thread = threading.Thread(target=nxt.serve_forever, daemon=True)
            thread.start()
            try:
                assert proc.line() == f"ok {EPERM}"  # the next server's decision
                assert nxt.stats().refused == {SessionKind.NVDEC: 1}
            finally:
                nxt.close()
                thread.join(10)
            assert proc.call(f"alloc {NVDEC:#x} 0x3") == ENOSYS  # the last copy closed: fails, never waits
    finally:
        loop.close()


@needs_notify
def test_a_kept_listener_s_pending_session_gets_the_loop_s_decision() -> None:
    """A new session still waiting for the loop's decision when the listener is kept for a restart is decided by
    the loop, not admitted past its cap: here the loop is busy at the stop and decides (refuses) after it."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    busy, released = threading.Event(), threading.Event()

    def hold_the_loop() -> None:
        busy.set()
        released.wait(30)

    held = _listener()
    try:
        with held as (_, proc):
            sup = SessionSupervisor(held.release(), "t", lambda *_: False)
            sup.attach(loop)
            loop.call_soon_threadsafe(hold_the_loop)
            assert busy.wait(10)
            proc.send(f"alloc {GRAPHICS:#x} 0x1")
            wait_for(lambda: sup.stats().pending == 1, "the session call to wait for the loop")
            waiting = threading.Event()
            await_decisions = sup._await_decisions

            def entered() -> None:
                waiting.set()
                await_decisions()

            sup._await_decisions = entered  # type: ignore[method-assign]
            sup.close(join_s=0, keep=True)
            assert waiting.wait(10), "the stopping supervisor should wait for the loop's decision"
            released.set()
            assert proc.line() == f"ok {EPERM}"  # the loop's decision, made after the stop
            sup.join(10)
            kept = sup.take_kept()
            assert kept is not None
            os.close(kept)
    finally:
        released.set()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


@needs_notify
def test_a_listener_whose_processes_exited_is_not_kept() -> None:
    held = _listener()
    with held as (_, proc):
        sup = SessionSupervisor(held.release(), "t", lambda *_: True)  # not serving: close() finishes it here
        proc.send("exit")
        assert proc.popen.wait(10) == 0
        sup.close(keep=True)
        assert sup.closed and sup.take_kept() is None


# --- real daemons -----------------------------------------------------------------------------------------------------
@dataclass
class PassedDaemon(Daemon):
    """A daemon started as systemd starts one with stored fds: each at 3, 4, ... with LISTEN_FDS, LISTEN_FDNAMES and
    LISTEN_PID (set by a wrapper that then execs the daemon, keeping its pid)."""

    passed: tuple[tuple[int, str], ...] = ()

    def _spawn(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        with systemd_start(self.passed, self.argv()) as (cmd, fds, env):
            return subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=env, pass_fds=fds)


class RunProc(Proc):
    """The command of a `unisched run`, driven like test_seccomp's helper processes."""

    def __init__(self, popen: subprocess.Popen[str]) -> None:
        self.popen = popen


def _events(log: Path, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == event]


@needs_notify
@pytest.mark.parametrize("b_fails", [False, True], ids=["restarted", "restart-fails"])
def test_a_restart_under_systemd_carries_a_running_process_s_hooks(
    daemon_factory: Any, tenant_prefix: str, tmp_path: Path, store: FdStore, monkeypatch: pytest.MonkeyPatch,
    b_fails: bool,
) -> None:
    """`unisched run` under daemon A; A stops gracefully and stores the hook; a call made meanwhile waits; daemon B
    (passed the stored fd) answers it and drops the store's copy; B killed: the next call fails at once (ENOSYS),
    never waits for good. A B whose start fails (its metrics port is taken) after it took the hook stores nothing
    again: the call fails at once, however often systemd would restart it."""
    monkeypatch.setenv("NOTIFY_SOCKET", store.env)
    a = daemon_factory()
    name = f"{tenant_prefix}run"
    proc = RunProc(subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", a.socket, "--tenant", name, "--", sys.executable,
         str(CHILD), "tenant", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT))
    b: PassedDaemon | None = None
    try:
        assert proc.line(30) == "ready"
        assert proc.call(f"alloc {GRAPHICS:#x} 0x1") == ENOTTY  # served by A
        assert a.stop() == 0
        store.wait(lambda st: len(st.fds) == 1, "daemon A's listener in the store")
        (stored,) = store.fds
        assert stored.startswith(FD_NAME_PREFIX)
        assert _events(a.log_path, "session hooks handed to systemd for the next start")[0]["stored"] == 1
        proc.send(f"alloc {NVDEC:#x} 0x2")
        assert proc.popen.stdout is not None
        assert not select.select([proc.popen.stdout], [], [], 0.3)[0], "with the hook in the store, the call waits"
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        fail = ("--metrics-port", str(taken.getsockname()[1]), "--metrics-listen", "127.0.0.1") if b_fails else ()
        b = PassedDaemon(a.socket, a.state_dir, None, tmp_path / "b.log", (*a.extra, *fail), a.prefix,  # type: ignore[arg-type]
                         subtree=a.subtree, passed=((store.fds[stored], stored),))
        if b_fails:
            with open(b.log_path, "ab") as log:
                b.proc = b._spawn(log)
            assert b.proc.wait(30) != 0
            taken.close()
            store.wait(lambda st: st.removed == [stored] and not st.fds, "B to drop the store's copy")
            assert proc.line(30) in (f"ok {ENOTTY}", f"ok {ENOSYS}")  # answered before B failed, or failed with it
            assert proc.call(f"alloc {NVDEC:#x} 0x3") == ENOSYS
            assert not store.fds and not _events(b.log_path, "session hooks handed to systemd for the next start")
            return
        taken.close()
        b.start()
        assert proc.line(30) == f"ok {ENOTTY}"  # answered by B
        carried = _events(b.log_path, "session hooks carried over the restart")
        assert carried and carried[0]["served"] == 1 and carried[0]["tenants"] == [name]
        store.wait(lambda st: st.removed == [stored] and not st.fds, "B to drop the store's copy")  # B's is the last
        assert not (Path(b.state_dir) / CARRIED_FILE).exists()
        b.stop(sig=9)
        assert proc.call(f"alloc {NVDEC:#x} 0x3") == ENOSYS  # after a crash: fails at once
    finally:
        proc.kill()
        if b is not None and b.proc.poll() is None:
            b.stop()
