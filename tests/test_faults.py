"""The daemon under faults of its tenants and its host: real daemon subprocesses, real cgroups, real processes
(hostile clients: test_faults_clients.py; NVML's faults: test_faults_nvml.py).

Waits poll real conditions with deadlines (wait_until); the fixed sleeps are measurement windows or, in the
SIGKILL loop, the random kill points themselves."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Daemon, child_env, wait_until
from test_daemon_cgroups import cpu_seconds, frozen, measure, start_tenant, stays_thawed, wait_registered

from unisched.scheduler.state import StateStore
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


def tenants(d: Daemon) -> dict[str, pb.Tenant]:
    """The daemon's tenants by name, asked in-process (a CLI call costs a Python start)."""
    with DaemonClient(d.socket, timeout=10) as c:
        return {t.name: t for t in c.tenants()}


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
        # both make progress: the weight-100 one its part of what the two get (a quarter), whatever else the
        # host's cores are busy with (an absolute floor failed at 0.072 of a core beside four busy loops)
        assert min(rates.values()) > 0.1 * sum(rates.values()) > 0, f"a tenant made no progress after the restarts: {rates}"
        assert_clean_log(daemon)
        daemon.stop(signal.SIGTERM)
        assert not any(driver.is_frozen(cg) for cg in cgroups), "SIGTERM left a cgroup frozen"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
