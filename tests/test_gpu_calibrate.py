"""On the GPU machine: `unisched calibrate --quick` measures the CUDA and render loads on GPU 0 and writes a file
the daemon's reader takes, under the name the daemon looks up (NVML's). About 45 s. Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, child_env
from test_gpu import _gpu_reason, _torch_reason

from unisched.policy.contention import ContentionMap
from unisched.scheduler.contention_file import MAX_KEPT
from unisched.scheduler.state import StateStore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))]


def test_quick_calibration_writes_a_file_the_daemon_reads(tmp_path: Path) -> None:
    if _torch_reason():
        pytest.skip(str(_torch_reason()))
    from unisched.telemetry.nvml import open_nvml_or_reason

    nvml, _ = open_nvml_or_reason()
    assert nvml is not None
    name = nvml.gpus()[0].name
    nvml.close()
    out = tmp_path / "contention.json"
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "unisched", "calibrate", "--quick", "--out", str(out),
                           "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=child_env())
    took = time.monotonic() - t0
    print(done.stdout, done.stderr[-3000:], f"took {took:.0f} s", sep="\n")
    assert done.returncode == 0, done.stderr[-3000:]
    kept = StateStore(tmp_path).measured_contention(name)
    assert kept is not None, json.loads(out.read_text())
    assert all(0.0 < k <= MAX_KEPT for k in kept)
    entry = json.loads(out.read_text())["gpus"][name]
    assert isinstance(entry["render_iterations"], int) and entry["render_iterations"] > 0  # the render was calibrated
    assert f"verdict: {ContentionMap.from_kept(*kept).name}" in done.stdout
    assert took < 90.0
