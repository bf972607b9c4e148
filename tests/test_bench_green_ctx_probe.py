"""bench/green_ctx_probe.py: what narrowing a trainer onto a green context would cost it (the arithmetic and the
report; the timing itself runs on the GPU machine: bench/README.md's queue)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import green_ctx_probe as probe

PROBE = [sys.executable, str(ROOT / "bench" / "green_ctx_probe.py")]


def test_a_switch_pair_costs_what_the_switching_step_adds_over_the_plain_one() -> None:
    cost = probe.switch_cost(plain_ms=100.0, switching_ms=107.0, switches_per_step=7)
    assert cost["us_per_pair"] == pytest.approx(1000.0)
    assert cost["overhead_at_rate"] == pytest.approx(0.02)  # one pair for each of 20 requests a second
    assert probe.switch_cost(100.0, 90.0, 7)["us_per_pair"] == 0.0  # noise below the plain step is no gain
    assert probe.switch_cost(100.0, 107.0, 0) == {"us_per_pair": None, "overhead_at_rate": None}


def test_the_report_names_each_size_its_kept_and_what_the_driver_refused() -> None:
    r = {"device": "NVIDIA H200", "sms": 132, "torch": "2.13", "cuda": "13.0", "green_supported": True,
         "mps_pipe": "/tmp/p", "model": "resnet50", "batch": 128, "steps": 30,
         "whole_device_ms": {"step": 30.0, "forward": 10.0, "train_forward": 14.0},
         "narrow": {"66": {"step_ms": 50.0, "step_kept": 0.6, "forward_ms": 12.5, "forward_kept": 0.8,
                           "train_forward_ms": 20.0, "train_forward_kept": 0.7},
                    "40": {"step_error": "invalid resource handle", "forward_ms": 20.0, "forward_kept": 0.5},
                    "3": {"error": "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"},
                    "24": {"step_ms": 90.0, "step_kept": 0.33, "step_narrow_backward_ms": 120.0,
                           "step_narrow_backward_kept": 0.25}},
         "switch": {"narrow_sms": 40, "pairs_per_step": 7, "step_ms": 37.0, "plain_ms": 30.0,
                    **probe.switch_cost(30.0, 37.0, 7)}}
    md = probe.markdown(r)
    assert "| SMs | forward only ms | kept | step's forward ms | kept | training step ms | kept |" in md
    assert "| all (132) | 10.00 | 1.00 | 14.00 | 1.00 | 30.00 | 1.00 |" in md
    assert "| 66 | 12.50 | 0.80 | 20.00 | 0.70 | 50.00 | 0.60 |" in md
    # forward measured, the run killed before the step's forward, backward refused: each said, none dropped
    assert "| 40 | 20.00 | 0.50 | not run |  | invalid resource handle |  |" in md
    assert "| 3 | CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION | | | | | |" in md and "MPS client: yes" in md
    assert "24 SMs, the context current on autograd's thread too: a step 120.00 ms, 0.25 kept." in md
    assert "1000 us a pair" in md and "lose 2.00% to switching" in md


def test_bad_sizes_are_refused_and_a_machine_without_a_gpu_says_so(tmp_path: Path) -> None:
    bad = subprocess.run([*PROBE, "--out", str(tmp_path), "--sms", "66,0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "SM counts must be positive" in bad.stderr
    neg = subprocess.run([*PROBE, "--out", str(tmp_path), "--switch-sms", "-1"], capture_output=True, text=True, timeout=60)
    assert neg.returncode == 2 and "--warmup and --switch-sms at least 0" in neg.stderr  # 0 (no switching) is allowed
    # the backward thread stays narrowed after that timing: every later setting of the process would be narrowed
    mixed = subprocess.run([*PROBE, "--out", str(tmp_path), "--narrow-backward", "--sms", "66,40", "--switch-sms", "0"],
                           capture_output=True, text=True, timeout=60)
    assert mixed.returncode == 2 and "give it one --sms size and --switch-sms 0" in mixed.stderr
    if shutil.which("nvidia-cuda-mps-control") is None:
        no_mps = subprocess.run([*PROBE, "--out", str(tmp_path), "--mps"], capture_output=True, text=True, timeout=60)
        assert no_mps.returncode == 2 and "MPS did not start: nvidia-cuda-mps-control not found" in no_mps.stderr
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe would run")
    out = subprocess.run([*PROBE, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "torch.cuda.is_available() is False" in out.stderr
    assert not (tmp_path / "results.json").exists()


def test_green_contexts_are_entered_by_either_torch_api() -> None:
    """torch renamed make_current / pop_current to set_context / pop_context; the GPU machine has torch 2.11."""
    calls: list[str] = []

    class Old:
        def make_current(self) -> None:
            calls.append("make")

        def pop_current(self) -> None:
            calls.append("pop")

    class New:
        def set_context(self) -> None:
            calls.append("set")

        def pop_context(self) -> None:
            calls.append("pop_context")

    for gc in (Old(), New()):
        enter, leave = probe.entered(gc)
        enter()
        leave()
    assert calls == ["make", "pop", "set", "pop_context"]
