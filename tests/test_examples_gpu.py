"""On the GPU machine: the numbered examples run end to end as cooperative tenants of a real daemon, each
printing its throughput and measured share; 05 runs two side by side. Skipped without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Daemon, child_env
from test_gpu import _gpu_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))]


def example(d: Daemon, script: str, tenant: str, tmp: Path, *extra: str, seconds: float = 4) -> dict:  # type: ignore[type-arg]
    report = tmp / f"{tenant}.json"
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--seconds", str(seconds), "--warmup", "15",
                        "--report", str(report), "--tenant", tenant, "--socket", d.socket, *extra],
                       capture_output=True, text=True, timeout=240, cwd=ROOT, env=child_env())
    print(script, p.returncode, p.stdout[-400:], p.stderr[-800:])
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(report.read_text())
    assert r["throughput"] > 0
    assert r["share"]["governed"] and r["share"]["gpu_seconds_reported"] > 0
    assert "share" in p.stdout and "measured" in p.stdout
    return r  # type: ignore[no-any-return]


@pytest.mark.parametrize(("script", "module", "extra"), [
    ("01_pycuda_kernel_loop.py", "pycuda", ()),
    ("02_pytorch_training.py", "torch", ("--model", "mlp")),
    ("03_egl_render.py", "OpenGL", ("--iterations", "50")),
    ("04_nvdec_decode.py", "av", ()),
])
def test_example_runs_as_a_cooperative_tenant(daemon_factory, tmp_path: Path, script: str, module: str,
                                              extra: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip(module, reason=f"{module} not installed (source .devcache/setup.sh on the GPU machine)")
    d: Daemon = daemon_factory(nvml=True)
    r = example(d, script, f"{d.prefix}{script[:2]}", tmp_path, *extra)
    assert r["share"]["measured_share"] > 0.5  # alone: it had the engine


def test_05_two_examples_side_by_side_share_by_weight(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torch")
    d: Daemon = daemon_factory("--slice-ms", "50", nvml=True)
    p = subprocess.run([sys.executable, str(ROOT / "examples/05_side_by_side.py"), "--a", "02", "--b", "02",
                        "--a-weight", "300", "--b-weight", "100", "--seconds", "10", "--warmup", "20",
                        "--socket", d.socket, "--out", str(tmp_path), "--", "--model", "mlp"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=child_env())
    print(p.stdout[-1500:], p.stderr[-1500:])
    assert p.returncode == 0, p.stderr[-2000:]
    a = json.loads((tmp_path / "ex02-a.json").read_text())
    b = json.loads((tmp_path / "ex02-b.json").read_text())
    assert a["window"]["late_s"] < 1 and b["window"]["late_s"] < 1, "the warm-up did not cover start-up"
    ratio = a["throughput"] / b["throughput"]
    assert 2.4 < ratio < 3.6, ratio


def test_pause_points_split_contended_steps_and_keep_the_shares(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two trainers at 1:1, each pausing after every 2nd weight layer: contended, their steps are split (and the
    parts charged), and the shares still follow the weights."""
    pytest.importorskip("torch")
    d: Daemon = daemon_factory("--slice-ms", "50", nvml=True)
    p = subprocess.run([sys.executable, str(ROOT / "examples/05_side_by_side.py"), "--a", "02", "--b", "02",
                        "--a-weight", "100", "--b-weight", "100", "--seconds", "8", "--warmup", "20",
                        "--socket", d.socket, "--out", str(tmp_path), "--", "--model", "mlp", "--pause-every", "2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=child_env())
    print(p.stdout[-1500:], p.stderr[-1500:])
    assert p.returncode == 0, p.stderr[-2000:]
    a = json.loads((tmp_path / "ex02-a.json").read_text())
    b = json.loads((tmp_path / "ex02-b.json").read_text())
    assert a["pause_splits"] > 0 and b["pause_splits"] > 0, (a["pause_splits"], b["pause_splits"])
    assert 0.7 < a["throughput"] / b["throughput"] < 1.4
