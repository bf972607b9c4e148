"""bench/_daemon.py: every benchmark daemon gets a cgroup subtree of its own, and stopping it removes the tenants'
cgroups there (never the hierarchy's root, never a production daemon's /unisched)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import benchrig  # noqa: F401  (bench/ on sys.path)
import pytest
from _daemon import own_subtree, remove_subtree, start_daemon, stop_daemon
from conftest import needs_freezer


def test_a_daemon_gets_its_own_subtree_unless_one_is_named() -> None:
    args, subtree = own_subtree(("--no-nvml",))
    assert subtree.startswith(f"unisched-bench-{os.getpid()}-") and args == ("--no-nvml", "--cgroup-subtree", subtree)
    assert own_subtree(("--cgroup-subtree", "mine"))[1] == "mine"
    assert own_subtree(("--cgroup-subtree=mine", "--no-nvml")) == (("--cgroup-subtree=mine", "--no-nvml"), "mine")
    assert own_subtree(())[1] != subtree  # each daemon of a run its own


@pytest.mark.parametrize("subtree", ["", "/", "//", "a/../..", ".."])
def test_remove_subtree_never_takes_a_hierarchys_root(subtree: str) -> None:
    with pytest.raises(ValueError):
        remove_subtree(subtree)


@needs_freezer
def test_stopping_a_bench_daemon_removes_its_tenants_cgroups() -> None:
    from unisched.enforce.cgroups import detect_driver

    work = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    daemon, _ = start_daemon(work, "--no-nvml")
    subtree = (work / "subtree").read_text()
    assert subtree != "unisched"
    driver = detect_driver("auto")
    driver.create(f"/{subtree}/a-tenant")  # as the daemon makes a tenant's
    assert driver.exists(f"/{subtree}/a-tenant")
    stop_daemon(daemon, work)
    assert daemon.returncode is not None
    assert not driver.exists(f"/{subtree}/a-tenant") and not driver.exists(f"/{subtree}")


@needs_freezer
def test_a_bench_daemon_killed_at_stop_leaves_no_tenant_frozen() -> None:
    """A daemon that does not stop on SIGTERM (here: stopped itself, SIGSTOP) is killed, and a killed daemon thaws
    nothing: stop_daemon thaws its tenants before removing its subtree, so none of their processes stays frozen."""
    import signal
    import subprocess

    from unisched.enforce.cgroups import detect_driver

    work = Path(tempfile.mkdtemp(prefix="bench-daemon-"))
    daemon, _ = start_daemon(work, "--no-nvml")
    subtree = (work / "subtree").read_text()
    driver = detect_driver("auto", subtree=subtree)
    tenant = f"/{subtree}/frozen-tenant"
    driver.create(tenant)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        driver.attach(tenant, sleeper.pid)
        driver.set_frozen(tenant, True)
        os.kill(daemon.pid, signal.SIGSTOP)
        stop_daemon(daemon, work, timeout_s=0.5)
        assert daemon.returncode == -signal.SIGKILL
        assert not driver.is_frozen(tenant)  # thawed (and left, since its process is still in it)
    finally:
        sleeper.kill()
        sleeper.wait()
        remove_subtree(subtree)
    assert not driver.exists(tenant)
