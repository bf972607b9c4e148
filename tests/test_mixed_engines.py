"""One weight across both ways of governing a tenant: a cooperative client (leases) beside an unmodified app under
`unisched run` (the freezer), end to end with real processes, cgroups and a real daemon.

No GPU here: the daemon runs with --cpu-stand-in, so CPU 0 plays GPU 0 (its busy fraction is the tenants' CPU time,
as NVML's utilization is on a GPU), and both tenants are pinned to it so they contend as two CUDA processes do.
The client burns its units on its own CPU clock (coop_worker --cpu-time), the app burns CPU (tests/hog.py); each
side's share is its cgroup's CPU time over a window. The saturation gate is set to slice always: a CI machine's own
processes share CPU 0, so the stand-in never reads saturated, and the gate is not what these tests are about.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, needs_freezer, wait_until
from test_daemon_cgroups import HOG, cpu_seconds

pytestmark = [needs_freezer, pytest.mark.root,
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs: one stands in for the GPU")]

WORKER = str(ROOT / "tests" / "coop_worker.py")
WINDOW_S = 5.0
"""Long enough for ~100 slices of 50 ms: a point of share is 50 ms, about one slice."""
LONG_WINDOW_S = 10.0
"""Units of 50 ms earn turns of 8 of them (Tuning.run_units): ~12 turns each at 1:1."""


def pin_daemon_away(d: Daemon) -> None:
    """Every thread of the daemon on CPU 1: on CPU 0 it would take time from whichever tenant runs."""
    for tid in os.listdir(f"/proc/{d.proc.pid}/task"):
        os.sched_setaffinity(int(tid), {1})


def pinned(log: Path, *cmd: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(["taskset", "-c", "0", *cmd], cwd=ROOT, env=child_env(), start_new_session=True,
                                stdout=out, stderr=out)


def shares(d: Daemon, tmp_path: Path, client_w: int, app_w: int, unit_ms: float, window_s: float) -> float:
    """The client's share of CPU 0 over `window_s`, its units `unit_ms` long. Long units are timed as a CUDA event
    pair times a GPU step: their own time plus the app's work that ran between their start and end (only the app's:
    a GPU runs no one else's work, and a loaded CI machine's other processes must not count)."""
    client, app = f"{d.prefix}c", f"{d.prefix}k"
    procs = [pinned(tmp_path / "app.log", sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", app,
                    "--weight", str(app_w), "--", sys.executable, HOG, "--seconds", "90")]
    try:
        wait_until(lambda: any(t["name"] == app and t["pids"] for t in d.tenants()), 30, "the app to register")
        beside = () if unit_ms < 10 else ("--beside-cgroup", str(d.cgroup_dir(app)))
        procs.append(pinned(tmp_path / "client.log", sys.executable, WORKER, "--socket", d.socket, "--tenant", client,
                            "--weight", str(client_w), "--seconds", "90", "--unit-ms", str(unit_ms), "--cpu-time",
                            *beside))
        wait_until(lambda: {t["name"] for t in d.tenants() if t["pids"]} >= {client, app}, 30,
                   "both tenants to register")
        dirs = {n: d.cgroup_dir(n) for n in (client, app)}
        time.sleep(1.0)  # settle: a measurement window, not a wait for a condition
        before = {n: cpu_seconds(p) for n, p in dirs.items()}
        time.sleep(window_s)  # the measurement window
        used = {n: cpu_seconds(p) - before[n] for n, p in dirs.items()}
    finally:
        for p in procs:
            os.killpg(p.pid, 9)
            p.wait(timeout=20)
    return used[client] / (used[client] + used[app])


@pytest.mark.parametrize(("client_w", "app_w"), [(100, 100), (300, 100)])
def test_a_client_beside_an_unmodified_app_gets_its_weight(daemon_factory, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                           client_w: int, app_w: int) -> None:
    d = daemon_factory("--cpu-stand-in", "--saturated-util", "0")
    pin_daemon_away(d)
    share = shares(d, tmp_path, client_w, app_w, 2.0, WINDOW_S)
    assert share == pytest.approx(client_w / (client_w + app_w), abs=0.03)


@pytest.mark.parametrize(("client_w", "app_w"), [(100, 100), (300, 100)])
def test_a_client_with_long_units_beside_an_unmodified_app_gets_its_weight(daemon_factory,  # type: ignore[no-untyped-def]
                                                                           tmp_path: Path, client_w: int,
                                                                           app_w: int) -> None:
    """Units of 50 ms: a revoked client finishes its unit beside the app thawed for its turn, and its timer counts
    the app's work in between (policy.reports). Charged that time, and the app charged none of it, the app got
    ~5 points over its share on the H200."""
    d = daemon_factory("--cpu-stand-in", "--saturated-util", "0")
    pin_daemon_away(d)
    share = shares(d, tmp_path, client_w, app_w, 50.0, LONG_WINDOW_S)
    assert share == pytest.approx(client_w / (client_w + app_w), abs=0.03)
