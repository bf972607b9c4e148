"""Daemon lifecycle: one daemon per socket, each daemon only its own cgroup subtree, nothing left frozen by a crash
followed by a restart that fails, and tenants kept (or picked up again) when the state file is damaged.

The real-daemon tests need root and a freezer. A tenant is frozen by writing its cgroup's freezer directly, as the
daemon would have: the daemon only writes a tenant's freezer when its own decision changes, so a lone tenant frozen
by hand stays frozen while the daemon runs, and a kill then leaves it frozen just as a kill mid-slice does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, needs_freezer, subtree_for, wait_until

from unisched.enforce.cgroups import CgroupDriver, check_subtree, detect_driver
from unisched.enforce.governed import GovernedRecord, RecordError, live_subtrees, parse_record, thaw_orphans
from unisched.scheduler.config import ConfigError, DaemonConfig, load_config

HOG = str(ROOT / "tests" / "hog.py")
NESTED = 100_000
"""Deeper than json's recursion limit: a state file of this many '[' raised RecursionError at start."""


def driver_of(d: Daemon) -> CgroupDriver:
    return detect_driver("auto", d.subtree)


def start_hog(d: Daemon, name: str, weight: int = 100) -> subprocess.Popen[bytes]:
    """A CPU-bound process in tenant `name`, registered through `unisched run`; returns once the daemon shows it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name, "--weight", str(weight),
         "--", sys.executable, HOG, "--seconds", "600"],
        cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_until(lambda: any(t["name"] == name and t["pids"] for t in d.tenants()), 30, f"tenant {name} to register")
    # and the hog itself runs (past the session-hook handshake with the daemon, which a kill would break)
    wait_until(lambda: any(_is_hog(pid) for pid in driver_of(d).pids(d.cgroup(name))), 30, f"{name}'s hog to start")
    return proc


def _is_hog(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1] == HOG.encode()


def end(proc: subprocess.Popen[bytes], d: Daemon, cgroup: str) -> None:
    """Kill a test process, thawing its cgroup first (the v1 freezer holds even SIGKILL while frozen)."""
    driver = driver_of(d)
    if driver.exists(cgroup):
        driver.set_frozen(cgroup, False)
    proc.kill()
    proc.wait(timeout=20)


def serve(d: Daemon, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`unisched serve` as the daemon's own command line, run to its exit (a start that fails)."""
    return subprocess.run(
        [sys.executable, "-m", "unisched", "serve", "--socket", d.socket, "--state-dir", d.state_dir, "--no-nvml",
         "--log-format", "json", *d.extra, *extra],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=child_env(),
    )


def events(d: Daemon) -> list[dict[str, object]]:
    out = []
    for line in d.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def shown(d: Daemon) -> dict[str, dict[str, object]]:
    return {t["name"]: t for t in d.tenants()}


# --- one daemon per state directory ------------------------------------------------------------------------------
@needs_freezer
@pytest.mark.root
def test_a_second_serve_on_a_live_daemon_s_state_directory_is_refused(daemon: Daemon, tenant_prefix: str,
                                                                        tmp_path: Path) -> None:
    """Its own socket and subtree but the first's state directory: each would replace the other's tenants in
    the one state file."""
    name = f"{tenant_prefix}kept"
    assert daemon.cli("run", "--tenant", name, "--weight", "300", "--keep", "--", "true").returncode == 0
    second = serve(daemon, "--socket", str(tmp_path / "second.sock"), "--cgroup-subtree", f"{daemon.subtree}-second",
                   timeout=30)
    assert second.returncode == 1, second.stderr
    assert f"another unisched daemon (pid {daemon.proc.pid}) keeps its state in {daemon.state_dir}" in second.stderr
    assert shown(daemon)[name]["weight"] == 300 and daemon.proc.poll() is None


# --- one daemon per socket ------------------------------------------------------------------------------------
@needs_freezer
@pytest.mark.root
def test_a_second_serve_on_a_live_socket_is_refused_and_the_first_keeps_serving(daemon: Daemon,
                                                                                 tenant_prefix: str) -> None:
    name = f"{tenant_prefix}first"
    hog = start_hog(daemon, name, weight=300)
    try:
        driver = driver_of(daemon)
        driver.set_frozen(daemon.cgroup(name), True)
        before = shown(daemon)[name]
        second = serve(daemon, timeout=30)  # the same command line again: an operator's slip, a second unit
        assert second.returncode == 1, second.stderr
        assert f"another unisched daemon (pid {daemon.proc.pid}) serves on {daemon.socket}" in second.stderr
        assert driver.is_frozen(daemon.cgroup(name)), "the refused daemon thawed the first one's tenant"
        assert daemon.proc.poll() is None and os.path.exists(daemon.socket)
        after = shown(daemon)[name]  # the first still answers, its tenant as it was
        assert {k: after[k] for k in ("weight", "pids", "cgroup")} == {k: before[k] for k in ("weight", "pids", "cgroup")}
        assert Path(f"{daemon.socket}.lock").read_text().strip() == str(daemon.proc.pid)
    finally:
        end(hog, daemon, daemon.cgroup(name))


@needs_freezer
@pytest.mark.root
def test_two_daemons_with_their_own_subtrees_never_touch_each_others_tenants(daemon_factory: Callable[..., Daemon],
                                                                            tenant_prefix: str) -> None:
    a = daemon_factory("--slice-ms", "20")
    name = f"{tenant_prefix}ofa"
    hog = start_hog(a, name)
    try:
        frozen_cg = a.cgroup(name)
        driver_of(a).set_frozen(frozen_cg, True)
        b = daemon_factory("--slice-ms", "20", name="b")  # a test daemon beside a production one
        assert b.subtree != a.subtree
        b_name = f"{tenant_prefix}ofb"
        out = b.cli("run", "--tenant", b_name, "--", "cat", "/proc/self/cgroup", check=True)
        assert f":/{b.subtree}/{b_name}\n" in out.stdout and name not in shown(b)
        assert b.stop(signal.SIGTERM) == 0
        assert driver_of(a).is_frozen(frozen_cg), "stopping one daemon thawed the other's tenant"
        assert [t["name"] for t in a.tenants()] == [name]
    finally:
        end(hog, a, a.cgroup(name))


@needs_freezer
@pytest.mark.root
def test_a_daemon_on_another_socket_but_the_same_subtree_is_refused(daemon_factory: Callable[..., Daemon],
                                                                   tenant_prefix: str, tmp_path: Path) -> None:
    a = daemon_factory("--slice-ms", "20")  # (the other daemon's directory is its own: its lease socket sits beside)
    out = subprocess.run(
        [sys.executable, "-m", "unisched", "serve", "--socket", f"/tmp/us-{tenant_prefix}/other/other.sock", "--state-dir",
         str(tmp_path / "other"), "--no-nvml", "--cgroup-subtree", f"{a.subtree}/nested"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=child_env(),
    )
    assert out.returncode == 1 and f"overlaps /{a.subtree}, which a running daemon governs" in out.stderr, out.stderr
    assert a.proc.poll() is None


@needs_freezer
@pytest.mark.root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a read-only mount of its own")
def test_a_runtime_agent_socket_directory_it_cannot_make_is_a_config_error_saying_to_install_the_unit(
        daemon_factory: Callable[..., Daemon], tenant_prefix: str, tmp_path: Path) -> None:
    """A host that kept an older systemd unit (RuntimeDirectory=unisched alone, ProtectSystem=strict) has /run
    read-only to the daemon but for /run/unisched, so /run/unisched-runtime cannot be made (EROFS): exit 2, which
    systemd does not restart into again and again, saying to install this release's unit. (A read-only tmpfs in a
    mount namespace of the daemon's own stands in for /run; `daemon_factory` only cleans up after it.)"""
    read_only = tmp_path / "run"
    read_only.mkdir()
    runtime_dir = read_only / "unisched-runtime"
    mount_then_run = 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"'
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount_then_run, str(read_only),
         sys.executable, "-m", "unisched", "serve", "--socket", f"/tmp/us-{tenant_prefix}/d.sock", "--state-dir",
         str(tmp_path / "state"), "--no-nvml", "--cgroup-subtree", subtree_for(tenant_prefix),
         "--runtime-agent-socket", str(runtime_dir / "seccomp-agent.sock")],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=child_env(),
    )
    assert out.returncode == 2, out.stderr
    assert f"config 'runtime_agent_socket': cannot make {runtime_dir}: Read-only file system" in out.stderr, out.stderr
    assert "re-run `python3 -m unisched install-service`" in out.stderr, out.stderr


# --- nothing left frozen by a kill followed by a restart that fails -------------------------------------------
def _kill_while_frozen(d: Daemon, name: str) -> tuple[subprocess.Popen[bytes], str]:
    hog = start_hog(d, name)
    cg = d.cgroup(name)
    driver_of(d).set_frozen(cg, True)
    d.stop(signal.SIGKILL)
    assert driver_of(d).is_frozen(cg)
    return hog, cg


@needs_freezer
@pytest.mark.root
def test_sigkill_while_frozen_then_a_bad_config_exits_2_with_the_tenant_thawed(daemon: Daemon, tenant_prefix: str,
                                                                              tmp_path: Path) -> None:
    hog, cg = _kill_while_frozen(daemon, f"{tenant_prefix}cfg")
    try:
        bad = tmp_path / "bad.toml"
        bad.write_text('[daemon]\nslice_ms = "fast"\n')
        out = serve(daemon, "--config", str(bad))
        assert out.returncode == 2 and "slice_ms" in out.stderr, out.stderr
        assert not driver_of(daemon).is_frozen(cg), "a restart that failed on its config left the tenant frozen"
        assert f"thawed cgroups left frozen by a daemon that is gone: /{daemon.subtree}" in out.stderr
    finally:
        end(hog, daemon, cg)


@needs_freezer
@pytest.mark.root
@pytest.mark.parametrize("damage", ["directory", "nested"])
def test_sigkill_while_frozen_then_a_broken_state_file_thaws_and_serves(daemon: Daemon, tenant_prefix: str,
                                                                       damage: str) -> None:
    name = f"{tenant_prefix}st"
    hog, cg = _kill_while_frozen(daemon, name)
    try:
        state = Path(daemon.state_dir) / "state.json"
        state.unlink()
        if damage == "directory":
            state.mkdir()
        else:
            state.write_text("[" * NESTED)
        daemon.start()
        assert not driver_of(daemon).is_frozen(cg), "the tenant is still frozen"
        said = [e for e in events(daemon) if str(e["event"]).startswith("state file unreadable")]
        assert said and Path(str(said[-1]["copy"])).name.startswith("state.json.corrupt-")
        assert not state.is_dir()
        # the live tenant's entry went with the file: it is governed again, not left to run unscheduled
        t = shown(daemon)[name]
        assert t["pids"] and t["weight"] == 100 and t["owner_uid"] == 0 and t["cgroup"] == cg
    finally:
        end(hog, daemon, cg)


@needs_freezer
@pytest.mark.root
def test_an_adopted_cgroup_frozen_at_a_kill_is_thawed_whatever_the_state_file(daemon: Daemon,
                                                                             tenant_prefix: str) -> None:
    ctr = f"/{daemon.subtree}-ctr"  # a container's cgroup outside the daemon's subtree
    driver = driver_of(daemon)
    driver.create(ctr)
    hog = subprocess.Popen([sys.executable, HOG, "--seconds", "600"])
    try:
        driver.attach(ctr, hog.pid)
        daemon.cli("adopt", "--tenant", f"{tenant_prefix}ctr", "--cgroup", ctr, check=True)
        driver.set_frozen(ctr, True)
        daemon.stop(signal.SIGKILL)
        (Path(daemon.state_dir) / "state.json").write_bytes(b"\x00garbage{")  # its path lived only there
        daemon.start()
        assert not driver.is_frozen(ctr), "the adopted cgroup is still frozen"
        thawed = [e for e in events(daemon) if e["event"] == "thawed cgroups left frozen by a previous run"]
        assert thawed and ctr in thawed[-1]["cgroups"]  # type: ignore[operator]
    finally:
        end(hog, daemon, ctr)


# --- a damaged state file costs only its damaged entries ------------------------------------------------------
@needs_freezer
@pytest.mark.root
def test_one_bad_entry_keeps_the_others_and_live_cgroups_are_readopted(daemon: Daemon, tenant_prefix: str) -> None:
    kept, lost = f"{tenant_prefix}kept", f"{tenant_prefix}lost"
    hogs = [start_hog(daemon, kept, weight=300), start_hog(daemon, lost, weight=250)]
    try:
        state = Path(daemon.state_dir) / "state.json"
        # registrations are saved by the tick within SAVE_DELAY_S: kill the daemon once both entries are on disk
        wait_until(lambda: state.exists() and all(f'"name":"{n}"' in state.read_text() for n in (kept, lost)), 20,
                   "both registrations in the state file")
        daemon.stop(signal.SIGKILL)
        lines = state.read_text().splitlines()
        bad = next(i for i, line in enumerate(lines) if f'"name":"{lost}"' in line)
        lines[bad] = lines[bad].replace('"weight":250', '"weight":"heavy"')
        state.write_text("\n".join(lines) + "\n")
        daemon.start()
        now = shown(daemon)
        assert now[kept]["weight"] == 300, "the good entry was dropped"
        assert now[lost]["weight"] == 100 and now[lost]["owner_uid"] == 0 and now[lost]["pids"]
        dropped = [e for e in events(daemon) if e["event"] == "state entry dropped"]
        assert len(dropped) == 1 and "heavy" in str(dropped[0]["why"])
        readopted = [e for e in events(daemon) if e["event"] == "re-adopted a live cgroup the state file did not name"]
        assert [e["tenant"] for e in readopted] == [lost]
        # it is scheduled like any tenant: the engine slices it (its slice count grows)
        first = int(str(now[lost]["slices"]))
        wait_until(lambda: int(str(shown(daemon)[lost]["slices"])) > first, 30, "the re-adopted tenant to be sliced")
    finally:
        for h, n in zip(hogs, (kept, lost), strict=True):
            end(h, daemon, daemon.cgroup(n))


# --- pure parts: the subtree name, the record of governed cgroups ---------------------------------------------
@pytest.mark.parametrize("bad", ["", "/", "a/../b", "..", "a//b", "./a", "a b", "a\nb", "x" * 300])
def test_bad_subtrees_are_refused_naming_the_key(bad: str, tmp_path: Path) -> None:
    why = "'cgroup_subtree': must be a (non-empty string|path of cgroup names)"
    with pytest.raises(ConfigError, match=why):
        DaemonConfig().with_overrides(cgroup_subtree=bad)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\ncgroup_subtree = {json.dumps(bad)}\n")
    with pytest.raises(ConfigError, match=why):
        load_config(cfg)


def test_subtrees_are_normalised() -> None:
    assert check_subtree("/unisched-test/x/") == "unisched-test/x"
    assert DaemonConfig().cgroup_subtree == "unisched"
    assert DaemonConfig().with_overrides(cgroup_subtree="/ci.slice/").cgroup_subtree == "ci.slice"


def test_a_record_read_after_a_crash_skips_garbage_and_refuses_dotdot() -> None:
    text = ("subtree /unisched\nadopted /kubepods/pod1\nadopted /a/../../etc\nsubtree /\nadopted relative\n"
            "\x00\xff junk\nadopted /x/./y\nsubtree /unisched\nadopted /kubepods/pod1")
    got, skipped = parse_record(text)
    assert got.subtrees == ("/unisched",) and got.adopted == ("/kubepods/pod1",)
    assert len(skipped) == 5


def test_orphan_records_are_thawed_once_and_live_ones_left_alone(tmp_path: Path) -> None:
    """Without cgroups: the records themselves. A dead daemon's record is removed; a live one's is kept and its
    subtree counts for overlap."""
    live = GovernedRecord(tmp_path, "live")
    live.note("/kubepods/pod1")
    live.note("/live/t1")  # inside its subtree: never listed
    assert live.path.read_text() == "subtree /live\nadopted /kubepods/pod1\n"
    dead = tmp_path / "0123.list"
    dead.write_text("subtree /nowhere-on-this-host\n")
    (tmp_path / "notes.txt").write_text("not a record")
    got = thaw_orphans([tmp_path])
    assert got.records == 1 and got.thawed == () and not dead.exists() and live.path.exists()
    assert [s for _, s in live_subtrees(tmp_path)] == ["/live"]
    with pytest.raises(RecordError, match="overlaps /live"):
        GovernedRecord(tmp_path, "live/inner")
    live.close()
    assert not live.path.exists() and thaw_orphans([tmp_path]).records == 0


def test_the_record_is_kept_where_neither_a_crash_nor_a_pod_reaches_it(tmp_path: Path) -> None:
    """systemd removes a unit's RuntimeDirectory whenever the unit stops, a crash before its automatic restart
    included (RuntimeDirectoryPreserve= defaults to no): a record there is gone exactly when the restart needs it.
    And pods get the daemon socket's directory mounted: the records (node cgroups, pod UIDs) are not theirs."""
    from unisched.enforce.governed import GOVERNED_DIR
    from unisched.integrations.kubernetes.plugin import tenant_edits
    from unisched.scheduler.config import DEFAULT_SOCKET, DEFAULT_STATE_DIR

    unit = dict(line.split("=", 1) for line in (ROOT / "deploy/systemd/unisched.service").read_text().splitlines()
                if "=" in line and not line.startswith("#"))
    governed = Path(GOVERNED_DIR)
    assert governed.is_relative_to(Path("/var/lib") / unit["StateDirectory"])
    assert governed.is_relative_to(DEFAULT_STATE_DIR)
    assert not any(governed.is_relative_to(Path("/run") / d) for d in unit["RuntimeDirectory"].split())
    mounted = tenant_edits("t", 100, (0,), DEFAULT_SOCKET, tmp_path).mounts
    assert mounted and not any(governed.is_relative_to(m) for m in mounted)


def test_the_orphan_thaw_also_reads_where_records_were_kept_before(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that died before an upgrade left its record in the old directory: the next start thaws it too.
    A directory named in the environment (tests, a second instance) is read alone."""
    from unisched.enforce.governed import GOVERNED_DIR, GOVERNED_DIR_ENV, LEGACY_GOVERNED_DIR, orphan_dirs

    monkeypatch.delenv(GOVERNED_DIR_ENV, raising=False)
    assert orphan_dirs() == (Path(GOVERNED_DIR), Path(LEGACY_GOVERNED_DIR))
    monkeypatch.setenv(GOVERNED_DIR_ENV, str(tmp_path / "mine"))
    assert orphan_dirs() == (tmp_path / "mine",)
    new, old = tmp_path / "new", tmp_path / "old"
    for d in (new, old):
        d.mkdir(mode=0o700)
        (d / "dead.list").write_text("subtree /nowhere-on-this-host\n")
    got = thaw_orphans([new, old])
    assert got.records == 2 and not (new / "dead.list").exists() and not (old / "dead.list").exists()


def test_records_in_a_directory_others_can_write_are_not_acted_on(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could have written this record
    (shared / "1.list").write_text("subtree /kubepods\n")
    got = thaw_orphans([shared])
    assert got.records == 0 and (shared / "1.list").exists()
    assert got.problems and "its records are ignored" in got.problems[0]


def test_a_socket_something_answers_on_is_never_replaced(tmp_path: Path) -> None:
    """The main socket and the seccomp agent's go through one check: a stale socket file is removed, a file that
    is not a socket or a socket a live daemon answers on is refused (the agent socket was replaced regardless)."""
    import socket as _socket

    from unisched.transport.claim import replace_stale_socket

    live, stale, plain = tmp_path / "live.sock", tmp_path / "stale.sock", tmp_path / "plain"
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    listener.bind(str(live))
    listener.listen(1)
    dead = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    dead.bind(str(stale))  # bound, never listening: what a killed daemon leaves
    dead.close()
    plain.write_text("x")
    try:
        with pytest.raises(OSError, match="answers on"):
            replace_stale_socket(str(live))
        with pytest.raises(OSError, match="not a socket"):
            replace_stale_socket(str(plain))
        replace_stale_socket(str(stale))
        assert live.exists() and plain.exists() and not stale.exists()
        replace_stale_socket(str(tmp_path / "new" / "d.sock"))  # makes its directory
        assert (tmp_path / "new").is_dir()
    finally:
        listener.close()


def test_the_runtime_agent_socket_s_directory_is_made_the_daemon_s_alone_or_refused(tmp_path: Path) -> None:
    """Made 0700 where missing; narrowed to 0700 where systemd's RuntimeDirectory= or a Kubernetes hostPath made it
    0755, empty or holding only the socket (stale); refused, never narrowed, where it holds anything else
    (runtime_agent_socket = "/etc/rt.sock" must not make /etc root's alone), where others may write to it (a shared
    directory such as /tmp: what is in it need not be ours) or it is a link."""
    import errno

    from unisched.transport.claim import make_private_directory

    made, opened, stale, busy, shared, link = (
        tmp_path / n for n in ("made", "opened", "stale", "busy", "shared", "link"))
    assert make_private_directory(str(made), "rt.sock") is True
    for directory in (opened, stale, busy):
        directory.mkdir()
        directory.chmod(0o755)
    (stale / "rt.sock").touch()
    (busy / "passwd").touch()
    assert make_private_directory(str(opened), "rt.sock") is False
    assert make_private_directory(str(stale), "rt.sock") is False
    assert [(p.stat().st_uid, p.stat().st_mode & 0o7777) for p in (made, opened, stale)] == [(os.geteuid(), 0o700)] * 3
    with pytest.raises(OSError, match=f"{busy} holds other files \\(passwd\\).*a directory of its own"):
        make_private_directory(str(busy), "rt.sock")
    assert busy.stat().st_mode & 0o7777 == 0o755, "left as it was"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(OSError, match="others may write to"):
        make_private_directory(str(shared), "rt.sock")
    assert shared.stat().st_mode & 0o7777 == 0o1777
    link.symlink_to(made)
    with pytest.raises(OSError, match=f"{link} is a link") as refused:
        make_private_directory(str(link), "rt.sock")
    assert refused.value.errno in (errno.ENOTDIR, errno.ELOOP), refused.value  # (O_DIRECTORY checks first: ENOTDIR)
    if os.geteuid() == 0:  # (only root can give a directory away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(OSError, match="belongs to uid 65534"):
            make_private_directory(str(theirs), "rt.sock")
