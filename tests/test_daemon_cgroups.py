"""Freezer enforcement end to end: a real daemon, real cgroups, real CPU-bound processes standing in for GPU
work (the engine uses cgroup CPU time when there is no GPU signal). Needs root and a freezer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, needs_freezer, wait_until

from unisched.enforce.cgroups import CgroupDriver, CgroupError, detect_driver

pytestmark = [needs_freezer, pytest.mark.root]
HOG = str(ROOT / "tests" / "hog.py")


def cpu_seconds(cg_dir: Path) -> float:
    stat = cg_dir / "cpu.stat"
    if stat.exists():
        for line in stat.read_text().splitlines():
            if line.startswith("usage_usec"):
                return int(line.split()[1]) / 1e6
    # cgroup v1: cpuacct lives in its own hierarchy, same relative path
    acct = Path(str(cg_dir).replace("/freezer/", "/cpuacct/")) / "cpuacct.usage"
    return int(acct.read_text()) / 1e9


def start_tenant(d: Daemon, name: str, weight: int, *hog_args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name, "--weight", str(weight),
         "--keep", "--", sys.executable, HOG, *hog_args],
        cwd=ROOT, env=child_env(),
    )


def wait_registered(d: Daemon, names: list[str]) -> dict[str, Path]:
    wait_until(lambda: {t["name"] for t in d.tenants() if t["pids"]} >= set(names), 20, f"tenants {names} to register")
    return {n: d.cgroup_dir(n) for n in names}


def measure(dirs: dict[str, Path], seconds: float) -> dict[str, float]:
    before = {n: cpu_seconds(p) for n, p in dirs.items()}
    t0 = time.monotonic()
    time.sleep(seconds)  # a measurement window, not a wait for a condition
    elapsed = time.monotonic() - t0
    return {n: (cpu_seconds(p) - before[n]) / elapsed for n, p in dirs.items()}


def frozen(cg_dir: Path) -> bool:
    f = cg_dir / "cgroup.freeze"
    if f.exists():
        return f.read_text().strip() == "1"
    return (cg_dir / "freezer.state").read_text().strip() != "THAWED"


def stays_thawed(cg_dir: Path, seconds: float) -> bool:
    """Whether the freezer left the cgroup thawed through a window of `seconds` (sampled every 10 ms): a tenant that
    should have the whole share is never frozen. Its CPU rate says the same only on an idle host, not a loaded one."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if frozen(cg_dir):
            return False
        time.sleep(0.01)  # the window's sampling, not a wait for a condition
    return True


def test_weights_3_to_1_give_cpu_ratio_3(daemon: Daemon, tenant_prefix: str) -> None:
    a, b = f"{tenant_prefix}a", f"{tenant_prefix}b"
    # the hogs burn until the checks are done (a fixed lifetime could end before them on a slow host)
    procs = [start_tenant(daemon, a, 300, "--seconds", "600"), start_tenant(daemon, b, 100, "--seconds", "600")]
    try:
        dirs = wait_registered(daemon, [a, b])
        measure(dirs, 1.0)  # settle
        rates = measure(dirs, 8.0)
        ratio = rates[a] / rates[b]
        # The daemon splits the time the tenants are thawed 3:1; what each burns while thawed also depends on the
        # host's other work competing for its core, so on a loaded host the CPU ratio strays further than the
        # split (seen 2.45 with four busy loops beside it). Weights ignored would give 1.
        assert 2.4 <= ratio <= 3.6, f"CPU ratio {ratio:.2f} (rates {rates})"
        # exclusive slicing: together they use about one core, not two
        assert rates[a] + rates[b] < 1.3
        # a target share is among the tenants that want the GPU at that instant: on a host loaded enough that one
        # hog showed no demand for a moment, the other's read 1.0 (seen with a second test run and busy loops beside
        # CI). Weights ignored would never show 0.75/0.25.
        def split() -> dict[str, dict[str, float]] | None:
            shown = {t["name"]: t for t in daemon.tenants()}
            return shown if (abs(shown[a]["target_share"] - 0.75) < 1e-6
                             and abs(shown[b]["target_share"] - 0.25) < 1e-6) else None
        shown = wait_until(split, 30, "the daemon to show the 3:1 target split")
        assert abs(shown[a]["measured_share"] - 0.75) < 0.05
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def test_tenant_alone_runs_unfrozen(daemon: Daemon, tenant_prefix: str) -> None:
    a = f"{tenant_prefix}solo"
    proc = start_tenant(daemon, a, 100, "--seconds", "6")
    dirs = wait_registered(daemon, [a])
    assert stays_thawed(dirs[a], 4.0), "alone it was frozen"
    assert proc.wait(timeout=30) == 0


def test_idle_share_is_lent_and_returns_on_wake(daemon: Daemon, tenant_prefix: str, tmp_path: Path) -> None:
    a, b = f"{tenant_prefix}busy", f"{tenant_prefix}sleeper"
    fifo = tmp_path / "wake"
    os.mkfifo(fifo)
    # the busy tenant burns until the checks are done: 16 s ran out on a loaded 2-core machine before the two had
    # registered and settled (state "idle" throughout), or during the measurement after the wake (rate 0.0)
    pa = start_tenant(daemon, a, 100, "--seconds", "600")
    pb = start_tenant(daemon, b, 100, "--seconds", "6", "--wake-fifo", str(fifo))
    try:
        _lent_and_returned(daemon, a, b, fifo)
        assert pb.wait(timeout=30) == 0
    finally:
        for p in (pa, pb):
            p.terminate()
            p.wait(timeout=30)


def _lent_and_returned(daemon: Daemon, a: str, b: str, fifo: Path) -> None:
    dirs = wait_registered(daemon, [a, b])

    last = [-1.0]

    def settled() -> bool:
        # both interpreters started and the sleeper blocked on its FIFO: start-up burns CPU on both cores of a CI
        # runner, which is not the lending this test is about
        state = {t["name"]: t["state"] for t in daemon.tenants()}
        used, last[0] = last[0], cpu_seconds(dirs[b])
        return state.get(a) == "running" and state.get(b) == "idle" and used == last[0]

    wait_until(settled, 30, "the busy tenant to run and the sleeper to be seen idle")
    before = cpu_seconds(dirs[b])
    assert stays_thawed(dirs[a], 3.0), "idle tenant's share not lent: the busy tenant was still sliced"
    assert cpu_seconds(dirs[b]) - before < 0.15  # the sleeper slept
    with open(fifo, "w") as f:
        f.write("go\n")
    back = measure(dirs, 4.0)
    assert 0.38 <= back[b] / (back[a] + back[b]) <= 0.62, f"woken tenant's share did not return: {back}"


def test_sigkill_then_restart_leaves_nothing_frozen(daemon: Daemon, tenant_prefix: str) -> None:
    a, b = f"{tenant_prefix}x", f"{tenant_prefix}y"
    # they burn until the test kills them (30 s could run out during a slow restart on a loaded machine)
    procs = [start_tenant(daemon, a, 100, "--seconds", "600"), start_tenant(daemon, b, 300, "--seconds", "600")]
    dirs = wait_registered(daemon, [a, b])

    def one_frozen() -> bool:
        return any(t["state"] == "frozen" for t in daemon.tenants())

    wait_until(one_frozen, 10, "one tenant to be frozen")

    driver = detect_driver("auto")
    daemon.stop(signal.SIGKILL)
    # the kill can land at any point of a slice; make sure it left a tenant frozen so the restart has work
    cgroups = [daemon.cgroup(a), daemon.cgroup(b)]
    if not any(driver.is_frozen(cg) for cg in cgroups):
        driver.set_frozen(cgroups[0], True)
    left_frozen = [cg for cg in cgroups if driver.is_frozen(cg)]
    daemon.start()
    # the new daemon slices the two again (one is frozen at any time), so judge by what it logged and by progress
    events = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
    thawed = [e for e in events if e["event"] == "thawed cgroups left frozen by a previous run"]
    assert thawed and set(left_frozen) <= set(thawed[-1]["cgroups"])
    # progress, not a rate: the weight-100 tenant's quarter of a core measured 0.06 CPU s/s over 2 s on a loaded
    # 2-core machine (0.25 idle); a tenant left frozen makes none at all
    before = {n: cpu_seconds(p) for n, p in dirs.items()}
    wait_until(lambda: all(cpu_seconds(p) - before[n] > 0.1 for n, p in dirs.items()), 20,
               "both tenants to make progress after the restart")
    known = {t["name"]: t for t in daemon.tenants()}
    assert known[a]["weight"] == 100 and known[b]["weight"] == 300
    daemon.stop(signal.SIGTERM)
    assert not any(driver.is_frozen(cg) for cg in cgroups), "SIGTERM left a cgroup frozen"
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def usage_driver(prefer: str) -> CgroupDriver:
    """The real driver of that cgroup version, skipping where it is absent or has no CPU usage to read."""
    try:
        driver = detect_driver(prefer)
    except CgroupError as e:
        pytest.skip(f"no cgroup {prefer} freezer here: {e}")
    if getattr(driver, "cpuacct", True) is None:
        pytest.skip("cgroup v1 freezer without a cpuacct hierarchy: no CPU usage to read")
    return driver


@pytest.mark.parametrize("prefer", ["v2", "v1"])
def test_the_drivers_read_cpu_usage_and_say_when_the_cgroup_is_gone(prefer: str, tenant_prefix: str) -> None:
    """The slice path reads every tenant's CPU time each slice and learns from the same read that a cgroup was
    removed underneath the daemon (no separate existence check)."""
    driver = usage_driver(prefer)
    cg = driver.tenant_cgroup(f"{tenant_prefix}usage")
    driver.create(cg)
    burn = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 0.3\nwhile time.time() < end: pass"])
    try:
        driver.attach(cg, burn.pid)
    finally:
        burn.wait()
    usage = driver.cpu_usage_s(cg)
    assert usage is not None and usage > 0.05
    driver.remove(cg)
    assert driver.cpu_usage_s(cg) is None


@pytest.mark.parametrize("prefer", ["v2", "v1"])
def test_a_cgroup_removed_between_the_open_and_the_read_reads_as_gone(
    prefer: str, tenant_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel fails a read with ENODEV, not ENOENT, when the cgroup goes after the file was opened: the race
    CI once hit as a traceback in the slice loop. Here the removal lands in that window every time."""
    driver = usage_driver(prefer)
    cg = driver.tenant_cgroup(f"{tenant_prefix}race")
    driver.create(cg)
    real_open = os.open
    opened: list[str] = []

    def open_then_remove(path: str, flags: int, *args: int) -> int:
        fd = real_open(path, flags, *args)
        if cg in str(path):
            opened.append(str(path))
            driver.remove(cg)
        return fd

    monkeypatch.setattr(os, "open", open_then_remove)
    try:
        assert driver.cpu_usage_s(cg) is None
    finally:
        monkeypatch.undo()
        driver.remove(cg)
    assert opened, "the usage read did not go through os.open: the race was not exercised"
    assert not driver.exists(cg)
