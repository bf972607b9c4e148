"""Tenants that `unisched run` creates go away when their last process exits (unless kept or declared), so a
non-admin's runs never pile up against MAX_USER_TENANTS; owners may remove their own tenants.

Real daemon, real cgroups and real processes (root); the engine's rules also against fake cgroups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, needs_freezer, wait_until

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.leases import FakeLeaseChannel
from unisched.policy import Engine, Priority
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig, DeclaredTenant
from unisched.scheduler.core import Scheduler
from unisched.scheduler.registration import MAX_USER_TENANTS
from unisched.scheduler.state import SavedTenant, StateStore
from unisched.scheduler.upkeep import MEMORY_CHECK_S
from unisched.telemetry import NoGpuTelemetry

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
NOBODY = 65534
GONE_S = 15.0
"""Generous: the daemon looks once a second; the machine may be loaded."""

# `unisched run` itself (the CLI's main, in this process) as another uid: imports as root, drops to UID, then runs
# `main(["run", ...])` for each tenant named, printing each exit code. No session hooks: their helper would be a
# fresh interpreter, and what is tested here is the tenant's lifetime.
RUNS_AS = r"""
import json, os, sys
from unisched.cli.main import main
from unisched.transport.client import DaemonClient
sock, uid, names = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
with DaemonClient(sock) as c:  # gRPC imports parts of itself at first use: from root's install, before dropping
    c.status()
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
print(json.dumps([main(["run", "--socket", sock, "--tenant", n, "--no-session-hooks", "--", "true"]) for n in names]))
"""

# As another uid: keep a tenant of its own, then remove it and one it does not own; prints what each call got.
REMOVES_AS = r"""
import json, os, sys
from unisched.transport.client import DaemonClient, DaemonError
from unisched_wire import unisched_pb2 as pb
sock, uid, mine, other = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
c = DaemonClient(sock)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
c.register(pb.RegisterRequest(tenant=mine))  # this process stays in it: the tenant stays until removed
out = {}
for label, name in (("other", other), ("mine", mine)):
    try:
        c.remove(name)
        out[label] = "OK"
    except DaemonError as e:
        out[label] = f"{e.code.name}: {e}"
print(json.dumps(out))
"""


def as_user(script: str, *args: str) -> object:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120,
                         env=child_env(), cwd="/tmp")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def names(d: Daemon) -> set[str]:
    return {t["name"] for t in d.tenants()}


@needs_freezer
@pytest.mark.root
def test_a_run_tenant_goes_away_when_its_last_process_exits_and_a_kept_one_stays(daemon: Daemon,
                                                                                  tenant_prefix: str) -> None:
    kept, once = f"{tenant_prefix}kept", f"{tenant_prefix}once"
    out = daemon.cli("run", "--tenant", once, "--", "cat", "/proc/self/cgroup", check=True)
    assert f"{daemon.cgroup(once)}\n" in out.stdout  # it ran as the tenant
    keep = daemon.cli("run", "--tenant", kept, "--weight", "300", "--keep", "--", "true")
    root = Path(daemon.status()["cgroup_root"])
    wait_until(lambda: once not in names(daemon), GONE_S, "the finished run's tenant to go away")
    assert keep.returncode == 0, keep.stderr
    assert not (root / daemon.cgroup(once).lstrip("/")).exists(), "its cgroup was left behind"
    shown = {t["name"]: t for t in daemon.tenants()}
    assert shown[kept]["base_weight"] == 300, "run --keep's tenant went away with its process"
    assert (root / daemon.cgroup(kept).lstrip("/")).is_dir()


@needs_freezer
@pytest.mark.root
def test_a_tenant_whose_process_exited_while_the_daemon_was_down_goes_away_at_restart(daemon: Daemon,
                                                                                     tenant_prefix: str) -> None:
    """The flag lives in the state file: a run tenant restored after a restart is still one that goes away."""
    name = f"{tenant_prefix}down"
    proc = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", name,
                             "--no-session-hooks", "--", "sleep", "60"], cwd=ROOT, env=child_env())
    try:
        wait_until(lambda: any(t["name"] == name and t["pids"] for t in daemon.tenants()), 20, "the run to register")
        procs = daemon.cgroup_dir(name) / "cgroup.procs"
        assert daemon.stop() == 0
        for pid in procs.read_text().split():  # the run and its `sleep` end while no daemon runs
            os.kill(int(pid), signal.SIGKILL)
        wait_until(lambda: not procs.read_text().split(), 10, "the tenant's processes to exit")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    daemon.start()
    wait_until(lambda: name not in names(daemon), GONE_S, "the restored run tenant to go away once empty")


@needs_freezer
@pytest.mark.root
def test_a_declared_tenant_stays_after_a_run_in_it_exits(daemon_factory, tenant_prefix: str,  # type: ignore[no-untyped-def]
                                                         tmp_path: Path) -> None:
    declared, canary = f"{tenant_prefix}decl", f"{tenant_prefix}canary"
    cfg = tmp_path / "d.toml"
    cfg.write_text(f'[[tenants]]\nname = "{declared}"\nweight = 250\n')
    d: Daemon = daemon_factory("--config", str(cfg))
    d.cli("run", "--tenant", declared, "--", "true", check=True)
    d.cli("run", "--tenant", canary, "--", "true", check=True)
    wait_until(lambda: canary not in names(d), GONE_S, "the undeclared run tenant to go away")
    shown = {t["name"]: t for t in d.tenants()}
    assert shown[declared]["base_weight"] == 250


@needs_root
@needs_freezer
@pytest.mark.root
def test_a_non_admin_can_run_more_than_the_tenant_limit_one_after_another(daemon: Daemon, tenant_prefix: str) -> None:
    """Each run is a new tenant; once its process exits the tenant goes, so the limit bounds live tenants only.
    Before, the 33rd run failed with 'already created 32 tenants ... remove some first' for good."""
    first = [f"{tenant_prefix}r{i}" for i in range(MAX_USER_TENANTS)]
    assert as_user(RUNS_AS, daemon.socket, str(NOBODY), json.dumps(first)) == [0] * MAX_USER_TENANTS
    wait_until(lambda: not any(t["owner_uid"] == NOBODY for t in daemon.tenants()), GONE_S,
               "the finished runs' tenants to go away")
    more = [f"{tenant_prefix}s{i}" for i in range(3)]
    assert as_user(RUNS_AS, daemon.socket, str(NOBODY), json.dumps(more)) == [0, 0, 0]


@needs_root
@needs_freezer
@pytest.mark.root
def test_an_owner_removes_its_own_tenant_and_not_another(daemon: Daemon, tenant_prefix: str) -> None:
    rooted, mine = f"{tenant_prefix}root", f"{tenant_prefix}mine"
    root_run = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant", rooted,
                                 "--no-session-hooks", "--", "sleep", "60"], cwd=ROOT, env=child_env())
    try:
        wait_until(lambda: rooted in names(daemon), 20, "root's run to register")
        got = as_user(REMOVES_AS, daemon.socket, str(NOBODY), mine, rooted)
        assert isinstance(got, dict)
        assert got["mine"] == "OK", got
        assert got["other"].startswith("PERMISSION_DENIED") and "belongs to uid 0" in got["other"], got
        assert names(daemon) == {rooted}
    finally:
        root_run.send_signal(signal.SIGTERM)  # forwarded to its sleep
        root_run.wait(timeout=20)


# --- the rules, against fake cgroups ----------------------------------------------------------------------
def _engine(tmp: Path, config: DaemonConfig | None = None) -> tuple[Scheduler, FakeCgroupDriver, FakeClock]:
    driver, clock = FakeCgroupDriver(), FakeClock()
    engine = Scheduler(config or DaemonConfig(), driver, NoGpuTelemetry(), StateStore(tmp / "state"), clock)
    engine.start()
    return engine, driver, clock


def _exit_all(driver: FakeCgroupDriver, cgroup: str) -> None:
    driver.groups[cgroup].pids.clear()


def _tick_past_check(engine: Scheduler, clock: FakeClock) -> None:
    clock.advance(MEMORY_CHECK_S + 0.01)
    engine.tick()


def test_only_emptied_run_tenants_are_removed(tmp_path: Path) -> None:
    engine, driver, clock = _engine(tmp_path, DaemonConfig(tenants=(DeclaredTenant("decl"),)))
    engine.register("once", None, None, (), (), 11, 1000, False, keep=False)
    engine.register("kept", None, None, (), (), 12, 1000, False, keep=True)
    engine.register("decl", None, None, (), (), 13, 1000, True, keep=False)
    engine.register("busy", None, None, (), (), 14, 1000, False, keep=False)
    _tick_past_check(engine, clock)
    assert {s.name for s in engine.snapshots()} == {"once", "kept", "decl", "busy"}  # all have a process
    for name in ("once", "kept", "decl"):
        _exit_all(driver, f"/unisched/{name}")
    _tick_past_check(engine, clock)
    assert {s.name for s in engine.snapshots()} == {"kept", "decl", "busy"}
    assert "/unisched/once" not in driver.groups
    assert engine._c.writer.wait(10.0), "the tick's save was never written"  # on the writer thread
    assert {t.name for t in StateStore(tmp_path / "state").load()} == {"kept", "decl", "busy"}


def test_an_owner_asking_to_keep_a_run_tenant_keeps_it(tmp_path: Path) -> None:
    engine, driver, clock = _engine(tmp_path)
    engine.register("t", None, None, (), (), 11, 1000, False, keep=False)
    engine.register("t", None, None, (), (), 12, 1000, False, keep=True)
    _exit_all(driver, "/unisched/t")
    _tick_past_check(engine, clock)
    assert engine.has_tenant("t")


def test_old_state_files_load_as_kept(tmp_path: Path) -> None:
    old = SavedTenant("t", 100, Priority.OFFLINE, frozenset({Engine.COMPUTE}), None, "/unisched/t", False, 0).to_json()
    del old["ephemeral"]
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "tenants": [old]}))
    (t,) = StateStore(tmp_path).load()
    assert not t.ephemeral


def test_a_run_tenant_with_a_lease_session_open_stays_and_a_lease_client_does_not_keep_it(tmp_path: Path) -> None:
    """A cooperative client's session is its claim on the tenant, whatever its cgroup shows; joining does not
    change whether the tenant goes when it is done."""
    engine, driver, clock = _engine(tmp_path)
    engine.register("t", None, None, (), (), 11, 1000, False, keep=False)
    sid, _ = engine.lease_open("t", None, None, ["compute"], 0, 12, 1000, False, FakeLeaseChannel())
    _exit_all(driver, "/unisched/t")
    _tick_past_check(engine, clock)
    assert engine.has_tenant("t")
    engine.lease_close(sid)
    _tick_past_check(engine, clock)
    assert not engine.has_tenant("t")
