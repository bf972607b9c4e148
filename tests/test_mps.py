"""MPS under the daemon: the control wrapper against a stand-in program, the engine with the fake, and a real
daemon on a socket whose `unisched run` starts its processes with the MPS client settings of their class.

The stand-in `nvidia-cuda-mps-control` keeps its state in files (a `control` file in the pipe directory while
"running") and notes each command; the real program runs in tests/test_gpu.py on the GPU machine."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, cli

from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.mps import FakeMpsControl, MpsError, NvidiaMpsControl
from unisched.policy import Mode, Priority
from unisched.policy.waits import DRIVER_WAIT_ENV
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import ConfigError, DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import NoGpuTelemetry

STANDIN = f"""#!{sys.executable}
import os, pathlib, sys
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
logs = pathlib.Path(os.environ["CUDA_MPS_LOG_DIRECTORY"])
logs.mkdir(parents=True, exist_ok=True)
def note(s):
    with open(logs / "calls", "a") as f:
        f.write(s + "\\n")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("STANDIN_MPS_FAIL"):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    (pipe / "control").touch()
    note("-d")
    sys.exit(0)
cmd = sys.stdin.read().strip()
if not (pipe / "control").exists():
    print("Cannot find MPS control daemon process", file=sys.stderr)
    sys.exit(1)
note(cmd)
if cmd == "get_server_list":
    print("4242")
elif cmd == "quit":
    (pipe / "control").unlink()
"""


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    prog = bin_dir / "nvidia-cuda-mps-control"
    prog.write_text(STANDIN)
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return prog


def calls(logs: Path) -> list[str]:
    return (logs / "calls").read_text().split() if (logs / "calls").exists() else []


def test_start_makes_its_directories_then_stop_asks_it_to_quit(tmp_path: Path, standin: Path) -> None:
    ctl = NvidiaMpsControl(tmp_path / "run" / "mps", tmp_path / "state" / "mps-log", binary=str(standin))
    st = ctl.start()
    assert st.running and not st.joined and st.servers == (4242,) and st.pipe_dir == str(tmp_path / "run" / "mps")
    assert calls(tmp_path / "state" / "mps-log") == ["-d", "get_server_list"]
    ctl.stop()
    assert calls(tmp_path / "state" / "mps-log")[-1] == "quit" and not ctl.status().running
    ctl.stop()  # nothing running: nothing asked
    assert calls(tmp_path / "state" / "mps-log").count("quit") == 1


def test_a_restarted_daemon_joins_the_control_daemon_it_left(tmp_path: Path, standin: Path) -> None:
    NvidiaMpsControl(tmp_path / "mps", tmp_path / "logs", binary=str(standin)).start()
    again = NvidiaMpsControl(tmp_path / "mps", tmp_path / "logs", binary=str(standin)).start()
    assert again.running and again.joined and calls(tmp_path / "logs").count("-d") == 1


def test_a_failed_start_carries_the_programs_words(tmp_path: Path, standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MPS_FAIL", "1")
    with pytest.raises(MpsError, match="exited 1: An instance of this daemon is already running"):
        NvidiaMpsControl(tmp_path / "mps", tmp_path / "logs", binary=str(standin)).start()
    with pytest.raises(MpsError, match="not found on PATH"):
        NvidiaMpsControl(tmp_path / "mps", tmp_path / "logs", binary=str(tmp_path / "none")).start()


def engine_with(tmp_path: Path, control: FakeMpsControl | None, driver: FakeCgroupDriver | None = None,
                **config: object) -> Scheduler:
    return Scheduler(DaemonConfig(**config), driver or FakeCgroupDriver(), NoGpuTelemetry(),  # type: ignore[arg-type]
                        StateStore(tmp_path / "state"), FakeClock(), None, control)


def test_the_engine_gives_each_class_its_client_settings_and_quits_mps_on_shutdown(tmp_path: Path) -> None:
    fake = FakeMpsControl("/run/u/mps")
    engine = engine_with(tmp_path, fake, mode=Mode.PREEMPTIVE, mps=True, mps_offline_sm_percent=40)
    engine.start()
    assert fake.running and engine.mps_status() is not None
    engine.register("train", None, Priority.OFFLINE, (), (), 1001, 0, True)
    engine.register("serve", None, Priority.ONLINE, (), (), 1002, 0, True)
    engine.register("render", None, Priority.OFFLINE, ("graphics",), (), 1003, 0, True)
    assert engine.snapshot("train").env == {"CUDA_MPS_PIPE_DIRECTORY": "/run/u/mps", "CUDA_MPS_CLIENT_PRIORITY": "1",
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40", **DRIVER_WAIT_ENV}
    assert engine.snapshot("serve").env == {"CUDA_MPS_PIPE_DIRECTORY": "/run/u/mps", "CUDA_MPS_CLIENT_PRIORITY": "0",
                                            **DRIVER_WAIT_ENV}
    assert engine.snapshot("render").env == DRIVER_WAIT_ENV  # no compute: no MPS settings
    engine.shutdown()
    assert fake.stops == 1 and not fake.running


def test_without_mps_no_tenant_gets_settings(tmp_path: Path) -> None:
    fake = FakeMpsControl()
    engine = engine_with(tmp_path, fake, mode=Mode.PREEMPTIVE)  # a control at hand, but mps not configured
    engine.start()
    engine.register("train", None, Priority.OFFLINE, (), (), 1001, 0, True)
    assert engine.snapshot("train").env == DRIVER_WAIT_ENV and engine.mps_status() is None and fake.starts == 0
    engine.shutdown()
    assert fake.stops == 0


def test_mps_that_does_not_start_stops_the_engine_before_it_restores_tenants(tmp_path: Path) -> None:
    driver = FakeCgroupDriver()
    first = engine_with(tmp_path, None, driver)
    first.start()
    first.register("train", None, None, (), (), 1001, 0, True)
    first.shutdown()
    driver.set_frozen("/unisched/train", True)  # as a crashed daemon leaves it
    engine = engine_with(tmp_path, FakeMpsControl(fail="nvidia-cuda-mps-control -d exited 1"), driver, mps=True)
    with pytest.raises(MpsError, match="exited 1"):
        engine.start()
    assert engine.tenant_count == 0
    assert not driver.is_frozen("/unisched/train")  # a daemon that cannot start leaves nothing frozen
    with pytest.raises(ConfigError, match="without an MPS control"):
        engine_with(tmp_path, None, mps=True)


def test_serve_mps_without_the_control_program_fails_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    out = cli("serve", "--mps", "--socket", str(tmp_path / "d.sock"), "--state-dir", str(tmp_path / "s"), "--no-nvml")
    assert out.returncode == 1 and "--mps: nvidia-cuda-mps-control not found on PATH" in out.stderr
    bad = cli("serve", "--mps-offline-sm-percent", "0", "--socket", str(tmp_path / "d.sock"))
    assert bad.returncode == 2 and "'mps_offline_sm_percent': must be an integer in 1..100" in bad.stderr


def test_unisched_run_starts_processes_as_mps_clients_of_their_class(
    daemon_factory, standin: Path, tenant_prefix: str, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.setenv("PATH", f"{standin.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_CLIENT_PRIORITY", "0")  # the caller's shell does not get the trainer first,
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "90")  # nor cap the online tenant
    d = daemon_factory("--mps", "--mode", "preemptive", "--mps-offline-sm-percent", "40")
    st = d.status()
    pipe = str(Path(d.socket).parent / "mps")
    assert st["mps"] == "running" and st["mps_pipe_dir"] == pipe
    show = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('CUDA_MPS_')}))"
    offline = d.cli("run", "--tenant", f"{tenant_prefix}-train", "--priority", "offline", "--no-session-hooks", "--keep", "--",
                    sys.executable, "-c", show, check=True)
    assert json.loads(offline.stdout) == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_CLIENT_PRIORITY": "1",
                                          "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    online = d.cli("run", "--tenant", f"{tenant_prefix}-serve", "--priority", "online", "--no-session-hooks", "--keep", "--",
                   sys.executable, "-c", show, check=True)
    assert json.loads(online.stdout) == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_CLIENT_PRIORITY": "0"}
    shown = {t["name"]: t["env"] for t in d.tenants()}  # what operators see: each tenant's settings
    assert shown[f"{tenant_prefix}-train"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    # a cooperative client started on its own takes the same settings at its registration, before its first CUDA call
    coop = ("import json, os; from unisched_client import Client; "
            f"c = Client({tenant_prefix + '-coop'!r}, socket={d.socket!r}, priority='offline'); " + show.split("; ", 1)[1])
    seen = subprocess.run([sys.executable, "-c", coop], capture_output=True, text=True, timeout=60, env=child_env())
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout) == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_CLIENT_PRIORITY": "1",
                                       "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"}
    assert d.stop() == 0
    assert calls(Path(d.state_dir) / "mps-log")[-1] == "quit"
