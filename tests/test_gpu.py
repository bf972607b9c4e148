"""On the GPU machine: real NVML telemetry and a real CUDA tenant under the daemon. Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env, egl_reason, wait_until


def _gpu_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as e:
        return f"no NVIDIA GPU/driver here ({type(e).__name__})"
    return None if n > 0 else "NVML sees no GPU"


def _torch_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))]

BURN = "import torch,time\nx=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nend=time.time()+{s}\n" \
       "while time.time()<end:\n    for _ in range(4): y=x@x\n    torch.cuda.synchronize()\n"
MARKED_BURN = "import os,torch,time\nx=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n" \
              "open(os.environ['BURN_MARK'],'w').close()\nend=time.time()+{s}\n" \
              "while time.time()<end:\n    for _ in range(4): y=x@x\n    torch.cuda.synchronize()\n"


def test_nvml_telemetry_sees_the_gpu_and_its_load() -> None:
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    from unisched.telemetry.nvml import open_nvml

    tel = open_nvml()
    assert tel is not None
    gpus = tel.gpus()
    assert gpus and gpus[0].memory_total > 0
    tel.sample()
    proc = subprocess.Popen([sys.executable, "-c", BURN.format(s=8)])
    try:
        util = wait_until(lambda: max(s.sm_util for s in tel.sample()) > 0.8 or None, 30, "SM utilization > 80%", 0.2)
        assert util
    finally:
        proc.wait(timeout=60)
        tel.close()


def test_nvml_shows_a_rendering_players_own_gpu_busy() -> None:
    """What the charge split's process rates rest on (scheduler.rates): NVML's per-process samples show an EGL
    player's process with SM time of its own. Where they do not, rationed players are split by CPU time alone
    (unisched_gpu_charged_seconds_total{rule="signal"}), and players that spin while they wait are charged wrong."""
    if egl_reason():
        pytest.skip(str(egl_reason()))
    from unisched.telemetry.nvml import open_nvml

    tel = open_nvml()
    assert tel is not None
    player = subprocess.Popen([sys.executable, "examples/cloud_gaming.py", "--role", "instance", "--fps", "0",
                               "--seconds", "12", "--warmup", "2", "--width", "640", "--height", "360",
                               "--iterations", "140"], cwd=ROOT, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        def own_busy() -> float | None:
            got = [s.process_sm.get(player.pid, 0.0) for s in tel.sample() if s.process_sm]
            return max(got) if got and max(got) > 0 else None

        busy = wait_until(own_busy, 20, "the player's pid in NVML's per-process samples with SM time", 0.1)
        assert 0 < busy <= 1.0
    finally:
        player.kill()
        out = player.communicate(timeout=30)[0]
        tel.close()
    assert "Traceback" not in out, out[-2000:]


def test_cuda_tenant_is_charged_gpu_seconds(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    d: Daemon = daemon_factory("--slice-ms", "50", nvml=True)
    assert d.status()["nvml"] is True
    name = f"{d.prefix}cuda"
    mark = tmp_path / "burning"
    p = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name,
                          "--", sys.executable, "-c", MARKED_BURN.format(s=10)], cwd=ROOT,
                         env={**child_env(), "BURN_MARK": str(mark)})
    try:
        wait_until(mark.exists, 60, "the tenant's first kernels")  # torch imported, a context made
        before = next(t for t in d.tenants() if t["name"] == name)
        assert before["gpu_seconds"] < 1.0, f"its CPU start-up was charged as GPU time: {before}"
        t = wait_until(lambda: next((t for t in d.tenants() if t["name"] == name and t["gpu_seconds"] > 2.0), None),
                       40, "GPU seconds to be charged")
        assert t["state"] == "running", f"a CUDA tenant busy on the GPU reads {t['state']!r}: {t}"
    finally:
        assert p.wait(timeout=60) == 0


MPS_CLIENT = ("import json, os, subprocess, torch\nx = torch.randn(1024, 1024, device='cuda')\n(x @ x).sum().item()\n"
              "out = subprocess.run(['nvidia-cuda-mps-control'], input='get_server_list\\n', capture_output=True, "
              "text=True).stdout\nprint(json.dumps({'servers': out.split(), 'sms': torch.cuda.get_device_properties(0)"
              ".multi_processor_count, 'env': {k: v for k, v in os.environ.items() if k.startswith('CUDA_MPS_')}}))\n")


def test_mps_daemon_serves_an_offline_tenant_capped(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """`serve --mps`: the real control daemon starts a server for the tenant's CUDA context; the tenant's process
    has its class's settings. The SM count it sees is printed, not asserted (drivers differ in what they report)."""
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    import shutil

    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("nvidia-cuda-mps-control is not on PATH")
    d: Daemon = daemon_factory("--mps", "--mode", "preemptive", "--mps-offline-sm-percent", "25", nvml=True)
    assert d.status()["mps"] == "running"
    out = d.cli("run", "--tenant", f"{d.prefix}train", "--priority", "offline", "--", sys.executable, "-c", MPS_CLIENT,
                timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print("MPS client:", seen)
    assert seen["servers"], "no MPS server started for the tenant's CUDA context"
    assert seen["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and seen["env"]["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert d.stop() == 0
