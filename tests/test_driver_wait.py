"""Governed processes start with the GPU driver's wait set to sleep (policy.waits): `unisched run`'s command and a
Kubernetes tenant's containers. A process that spins while it waits for other tenants' GPU work is charged for the
wait as CPU time, and its GPU share is split from CPU time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import Daemon

from unisched.integrations.kubernetes.plugin import tenant_edits
from unisched.policy.waits import DRIVER_WAIT_ENV
from unisched_wire.tenantenv import process_env

SHOW = "import json, os; print(json.dumps({k: os.environ.get(k) for k in ('__GL_YIELD', 'CUDA_MPS_PIPE_DIRECTORY')}))"


def test_unisched_run_starts_its_command_with_the_drivers_wait_set_to_sleep(
    daemon: Daemon, tenant_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("__GL_YIELD", "NOTHING")  # the caller's shell asked to spin: the daemon's setting wins
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/run/mine")  # no MPS in this daemon: the caller's own stays
    out = daemon.cli("run", "--tenant", f"{tenant_prefix}gl", "--no-session-hooks", "--keep", "--",
                     sys.executable, "-c", SHOW)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"__GL_YIELD": "USLEEP", "CUDA_MPS_PIPE_DIRECTORY": "/run/mine"}
    shown = {t["name"]: t["env"] for t in daemon.tenants()}  # what operators see
    assert shown[f"{tenant_prefix}gl"] == dict(DRIVER_WAIT_ENV)


def test_a_kubernetes_tenants_containers_get_the_same_setting(tmp_path: Path) -> None:
    edits = tenant_edits("t", 2, [0], "/run/unisched/unisched.sock", tmp_path)
    assert edits.envs["__GL_YIELD"] == "USLEEP"


def test_settings_without_mps_leave_the_inherited_mps_variables() -> None:
    inherited = {"PATH": "/bin", "CUDA_MPS_PIPE_DIRECTORY": "/run/mine", "__GL_YIELD": "NOTHING"}
    assert process_env(inherited, DRIVER_WAIT_ENV) == {"PATH": "/bin", "CUDA_MPS_PIPE_DIRECTORY": "/run/mine",
                                                       "__GL_YIELD": "USLEEP"}


def test_a_client_created_after_cuda_started_is_warned_only_about_settings_cuda_reads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client library applies the same settings to its own process at registration; it warns that CUDA
    started too early for them only where they include CUDA's (MPS), not for the GL driver's wait alone."""
    from types import SimpleNamespace

    from unisched_client import client

    monkeypatch.setattr(client.os, "environ", {"PATH": "/bin"})
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True)))
    with caplog.at_level("WARNING", logger="unisched_client"):
        client._apply_env(DRIVER_WAIT_ENV)
    assert client.os.environ == {"PATH": "/bin", "__GL_YIELD": "USLEEP"} and not caplog.records
    with caplog.at_level("WARNING", logger="unisched_client"):
        client._apply_env({**DRIVER_WAIT_ENV, "CUDA_MPS_CLIENT_PRIORITY": "1"})
    assert "['CUDA_MPS_CLIENT_PRIORITY']" in caplog.text
