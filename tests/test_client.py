"""The client library against a real daemon on a temporary socket, with CPU stand-in work in child
processes (registering moves the caller into the tenant's cgroup): lease sharing, reconnect, revocation,
overrun charging, bad requests, fail_open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, Daemon, child_env, wait_until

WORKER = str(ROOT / "tests" / "coop_worker.py")


def worker(d: Daemon, tenant: str, *extra: str, weight: int = 100, seconds: float = 3.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, "--socket", d.socket, "--tenant", tenant, "--weight", str(weight),
         "--seconds", str(seconds), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=ROOT,
    )


def result(p: subprocess.Popen[str], timeout: float = 60) -> dict:  # type: ignore[type-arg]
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"worker failed ({p.returncode}): {err[-2000:]}"
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def tenant(d: Daemon, name: str) -> dict:  # type: ignore[type-arg]
    return next((t for t in d.tenants() if t["name"] == name), {})


def test_two_cooperative_clients_at_3_to_1_share_3_to_1(daemon: Daemon, tenant_prefix: str) -> None:
    a = worker(daemon, f"{tenant_prefix}a", weight=300, seconds=4)
    b = worker(daemon, f"{tenant_prefix}b", weight=100, seconds=4)
    ra, rb = result(a), result(b)
    assert ra["connects"] == 1 and rb["connects"] == 1
    ratio = ra["used_s"] / rb["used_s"]
    assert 2.5 < ratio < 3.5, (ra, rb)
    # one holder at a time: their work never overlapped much (2 cores here would let them both run)
    assert ra["used_s"] + rb["used_s"] < 4.0 * 1.1
    ta = tenant(daemon, f"{tenant_prefix}a")
    # an honest client is never enforced; what the meter counts as overrun is late reports (2 busy cores here)
    assert ta["cooperative"] is False and not ta["enforced"] and ta["overrun_s"] < 0.1 * ra["used_s"]


def test_a_stopped_holder_is_revoked_and_the_other_gets_the_gpu(daemon_factory, tenant_prefix: str) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--slice-ms", "20", "--lease-timeout-ms", "200")
    a = worker(d, f"{tenant_prefix}a", seconds=6)
    b = worker(d, f"{tenant_prefix}b", seconds=6)
    wait_until(lambda: tenant(d, f"{tenant_prefix}b").get("state") in ("running", "waiting"), 20, "b to want the GPU")
    os.kill(b.pid, signal.SIGSTOP)  # hung: stops renewing
    try:
        wait_until(lambda: tenant(d, f"{tenant_prefix}b").get("state") == "idle", 10, "b's lease to be revoked")
        assert tenant(d, f"{tenant_prefix}a")["state"] == "running"
    finally:
        os.kill(b.pid, signal.SIGCONT)
    rb = result(b)
    result(a)
    assert rb["revokes"] >= 1


def test_a_client_survives_a_daemon_restart_and_registers_again(daemon: Daemon, tenant_prefix: str, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    p = worker(daemon, f"{tenant_prefix}a", "--ready-file", str(ready), seconds=8)
    wait_until(ready.exists, 20, "the client to register")
    daemon.stop()
    daemon.start()
    wait_until(lambda: tenant(daemon, f"{tenant_prefix}a").get("cooperative"), 20, "the client to re-register")
    r = result(p)
    assert r["connects"] >= 2 and r["units"] > 0


def test_unreachable_daemon_fails_clearly_unless_fail_open(tmp_path: Path) -> None:
    sock = str(tmp_path / "nobody.sock")
    p = subprocess.run([sys.executable, WORKER, "--socket", sock, "--tenant", "x", "--seconds", "0.2"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 3
    assert "cannot reach the unisched daemon" in p.stderr and "fail_open=True" in p.stderr
    p = subprocess.run([sys.executable, WORKER, "--socket", sock, "--tenant", "x", "--seconds", "0.2", "--fail-open"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    assert "UNGOVERNED" in p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["units"] > 0 and r["connects"] == 0


def test_an_overrunning_client_is_charged_and_then_frozen(daemon: Daemon, tenant_prefix: str) -> None:
    good = worker(daemon, f"{tenant_prefix}good", seconds=10)
    bad = worker(daemon, f"{tenant_prefix}bad", "--ignore-revokes", seconds=10)
    try:
        wait_until(lambda: tenant(daemon, f"{tenant_prefix}bad").get("enforced"), 20, "the overrunner to be enforced")
    except AssertionError:
        print("tenants:", json.dumps(daemon.tenants()))
        print("daemon log:", daemon.log_path.read_text()[-4000:])
        raise
    t = tenant(daemon, f"{tenant_prefix}bad")
    assert t["overrun_s"] > 0
    wait_until(lambda: tenant(daemon, f"{tenant_prefix}bad").get("state") == "frozen", 10, "the overrunner frozen")
    result(bad)
    result(good)
    assert not tenant(daemon, f"{tenant_prefix}good")["enforced"]


def test_bad_lease_requests_get_clear_errors(daemon: Daemon, tenant_prefix: str) -> None:
    p = subprocess.run([sys.executable, WORKER, "--socket", daemon.socket, "--tenant", f"{tenant_prefix}x", "--bad-requests"],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["want_before_hello"]["code"] == "INVALID_ARGUMENT" and "must be hello" in out["want_before_hello"]["details"]
    assert out["empty"]["code"] == "INVALID_ARGUMENT"
    assert out["bad_engine"]["code"] == "INVALID_ARGUMENT" and "engine must be one of" in out["bad_engine"]["details"]
    assert out["nan_report"]["code"] == "INVALID_ARGUMENT" and "gpu_seconds" in out["nan_report"]["details"]
    assert out["second_hello"]["code"] == "INVALID_ARGUMENT"
    assert out["bad_tenant"]["code"] == "INVALID_ARGUMENT"
    assert out["bad_gpu"]["code"] == "INVALID_ARGUMENT" and "no GPU 7" in out["bad_gpu"]["details"]
    assert daemon.status()["tenants"] >= 1  # still serving
