"""On the GPU machine: real NVML telemetry and a real CUDA tenant under the daemon. Skipped without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, Daemon, child_env, wait_until


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


def test_cuda_tenant_is_charged_gpu_seconds(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    d: Daemon = daemon_factory("--slice-ms", "50", nvml=True)
    assert d.status()["nvml"] is True
    name = f"{d.prefix}cuda"
    p = subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", d.socket, "--tenant", name,
                          "--", sys.executable, "-c", BURN.format(s=10)], cwd=ROOT,
                         env=child_env())
    try:
        t = wait_until(lambda: next((t for t in d.tenants() if t["name"] == name and t["gpu_seconds"] > 2.0), None),
                       40, "GPU seconds to be charged")
        assert t["state"] == "running"
    finally:
        assert p.wait(timeout=60) == 0
