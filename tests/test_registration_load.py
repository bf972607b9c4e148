"""Load: a burst of `unisched run` at default priority must not starve the daemon's replies.

200 real `python3 -m unisched run --tenant ... -- true` (session hooks on, as a user runs it) start at once
against a real daemon started as `serve` starts it. Each client waits at most its own deadline (10 s per call)
for the daemon; on 2 cores a daemon at nice 0 is one of ~200 runnable processes and gets ~1% of the CPU, so
replies queue past that deadline. Every run must exit 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, Daemon, child_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the daemon creates tenant cgroups")

RUNS = 200
"""Concurrent runs: the burst the issue measured (32-40% of them failed with a daemon at nice 0 on 2 cores)."""
BURST_DEADLINE_S = 300.0
"""How long the whole burst may take before a run still going counts as a failure: generous, since 200 Python
start-ups share a loaded 2-core machine (about 60-90 s); a hang must still end the test."""
DAEMON_NICE = -10
"""The config's default `nice` (scheduler.config.DEFAULT_NICE), which `serve` sets on itself."""


def _start_burst(daemon: Daemon, tmp: Path) -> list[tuple[subprocess.Popen[bytes], Path]]:
    procs = []
    env = child_env()
    for i in range(RUNS):
        err = tmp / f"run-{i}.err"
        with err.open("wb") as f:
            p = subprocess.Popen(
                [sys.executable, "-m", "unisched", "run", "--socket", daemon.socket, "--tenant",
                 f"{daemon.prefix}-{i}", "--", "true"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT, env=env,
            )
        procs.append((p, err))
    return procs


def _wait_all(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> list[str]:
    """Each failed run as 'exit N: last stderr line'; a run past the burst's deadline is killed and fails."""
    deadline = time.monotonic() + BURST_DEADLINE_S
    failed = []
    for p, err in procs:
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        if rc != 0:
            last = (err.read_text(errors="replace").strip().splitlines() or [""])[-1]
            failed.append(f"exit {rc}: {last}")
    return failed


def _thread_nices(pid: int) -> set[int]:
    """The nice value of every thread of `pid` (field 19 of /proc/PID/task/TID/stat)."""
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        nices.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return nices


def test_200_concurrent_runs_at_default_priority_all_succeed(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    daemon = daemon_factory()
    assert os.getpriority(os.PRIO_PROCESS, 0) >= 0, "the clients must run at default priority"
    started = time.monotonic()
    failed = _wait_all(_start_burst(daemon, tmp_path))
    took = time.monotonic() - started
    summary = {line: failed.count(line) for line in failed}
    assert not failed, f"{len(failed)}/{RUNS} runs failed in {took:.0f} s (load {os.getloadavg()[0]:.1f}): {summary}"
    assert daemon.proc.poll() is None, "the daemon died under the burst"
    assert _thread_nices(daemon.proc.pid) == {DAEMON_NICE}, "serve sets its nice value on every thread"


def test_a_hand_over_late_under_load_is_told_to_try_again(daemon: Daemon) -> None:
    """A run preempted between connecting to the agent socket and sending its listener (hundreds of runnable
    processes on 2 cores) misses the daemon's hand-over deadline: the reply must be "busy" (`hand_over` tries
    again), not an error that fails the run."""
    agent = str(Path(daemon.socket).with_name("seccomp-agent.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(agent)  # and send nothing, as if preempted here
        s.settimeout(30)
        reply = s.recv(4096).decode()
    assert reply.startswith("busy ") and "not complete within" in reply, reply


def test_nice_is_a_daemon_key_in_its_range(tmp_path: Path) -> None:
    from unisched.scheduler.config import ConfigError, load_config

    assert load_config(None).nice == DAEMON_NICE
    cfg = tmp_path / "c.toml"
    cfg.write_text("[daemon]\nnice = 5\n")
    assert load_config(cfg).nice == 5
    for bad in ("-21", "20", '"high"'):
        cfg.write_text(f"[daemon]\nnice = {bad}\n")
        with pytest.raises(ConfigError, match=r"'nice'.*-20\.\.19"):
            load_config(cfg)
    with pytest.raises(ConfigError, match="nice"):
        load_config(None).with_overrides(nice=-30)
