"""`unisched calibrate`: the fit, the checks and the file it writes (unisched.calibrate, scheduler.contention_file), and
the command end to end with CPU stand-ins for the GPU workloads (bench/cpu_standin.py: same arguments and report).
The real GPU run is tests/test_gpu_calibrate.py."""

from __future__ import annotations

import datetime as dt
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, child_env

from unisched.calibrate.command import NO_GPU, QUICK, STANDARD, Progress, estimate_s
from unisched.calibrate.fit import CalibrationError, Measured, kept_fractions, verdict_line
from unisched.scheduler.contention_file import (
    MAX_KEPT,
    ContentionFileError,
    contention_path,
    kept_of,
    make_entry,
    write_entry,
)
from unisched.scheduler.state import StateStore

GPU = "Test GPU"
STANDIN = f"{sys.executable} bench/cpu_standin.py"
NOW = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.UTC)


# ------------------------------------------------------------------------------------------ the fit


def _timeline(late_s: float, rate_alone: float, rate_shared: float, partner_from: float) -> tuple[tuple[float, float], ...]:
    """A timeline at `rate_alone` until the partner's first item, then at `rate_shared`, over a 12 s window."""
    points, items, t = [], 0.0, late_s
    while t <= 12.0:
        points.append((round(t, 3), float(round(items))))
        items += 0.5 * (rate_alone if t < partner_from else rate_shared)
        t += 0.5
    return tuple(points)


def test_a_late_partner_is_scored_over_the_seconds_both_ran() -> None:
    """The H200's trainer + render: the trainer's first step 4.5 s into a 12 s window, the render alone (35 frames/s)
    until then and at 31.5 beside it. Over the whole window the render would read 0.93 kept; it keeps 0.88."""
    cuda = _timeline(4.5, 330.0, 330.0, 0.0)
    render = _timeline(0.0, 35.0, 31.5, 4.5)
    together = [Measured("cuda", cuda[-1][1] / 7.5, cuda), Measured("render", render[-1][1] / 12.0, render)]
    assert together[1].throughput / 35.8 == pytest.approx(0.92, abs=0.01)  # what the whole window says
    kept = kept_fractions(Measured("cuda", 1650.0), Measured("render", 35.8), together)
    assert kept == pytest.approx((0.2, 0.88), abs=0.005)


def test_kept_fractions_of_runs_that_started_together() -> None:
    kept = kept_fractions(Measured("cuda", 604.6), Measured("render", 35.9),
                          [Measured("cuda", 82.9), Measured("render", 31.1)])
    assert kept == pytest.approx((0.13712, 0.86630), abs=1e-4)


@pytest.mark.parametrize("alone", [0.0, -1.0, math.nan])
def test_a_solo_run_without_throughput_gives_no_fraction(alone: float) -> None:
    with pytest.raises(CalibrationError, match="not positive"):
        kept_fractions(Measured("cuda", alone), Measured("render", 35.9), [Measured("cuda", 1.0), Measured("render", 1.0)])


@pytest.mark.parametrize(("kept", "says"), [((0.9, 0.95), "will not slice"), ((0.22, 0.92), "will mix slices"),
                                           ((0.06, 0.9), "as one domain")])
def test_the_calibration_says_what_the_daemon_will_do(kept: tuple[float, float], says: str) -> None:
    assert says in verdict_line(*kept)


def test_progress_says_the_step_and_the_time_left() -> None:
    out, now = io.StringIO(), [100.0]
    progress = Progress([("a", 10.0), ("b", 20.0), ("c", 30.0)], out, clock=lambda: now[0])
    progress.step()
    now[0] = 112.0
    progress.step()
    assert out.getvalue().splitlines() == ["calibrate +   0s [1/3] a (~10 s; about 60 s left)",
                                           "calibrate +  12s [2/3] b (~20 s; about 50 s left)"]
    assert estimate_s(QUICK) < 60.0 < estimate_s(STANDARD)  # the GPU test's mode fits its minute


# ------------------------------------------------------------------------------------------ the file


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.01, MAX_KEPT + 0.01, True, "0.5", None])
def test_a_kept_fraction_out_of_range_is_refused(value: Any) -> None:
    with pytest.raises(ContentionFileError):
        kept_of({"compute_kept": value, "graphics_kept": 0.5})
    with pytest.raises(ContentionFileError):
        make_entry(0.5, value, "c", None) if isinstance(value, float) else kept_of({"compute_kept": 0.5,
                                                                                       "graphics_kept": value})


def test_write_merges_keeps_other_gpus_and_the_daemon_reads_it(tmp_path: Path) -> None:
    path = contention_path(tmp_path)
    other = {"compute_kept": 0.9, "graphics_kept": 0.95, "measured_at": "2026-01-01T00:00:00Z", "command": "x",
             "render_iterations": 7}
    path.write_text(json.dumps({"version": 1, "gpus": {"Other": other, GPU: {}}}))
    entry = make_entry(0.123456, 0.87, "unisched calibrate", 447, now=NOW)
    assert entry == {"compute_kept": 0.1235, "graphics_kept": 0.87, "measured_at": "2026-12-01T10:00:00Z",
                     "command": "unisched calibrate", "render_iterations": 447}
    write_entry(path, GPU, entry)
    assert json.loads(path.read_text()) == {"version": 1, "gpus": {"Other": other, GPU: entry}}
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["contention.json"]  # no temp file left
    assert StateStore(tmp_path).measured_contention(GPU) == (0.1235, 0.87)
    assert StateStore(tmp_path).measured_contention("Other") == (0.9, 0.95)
    assert StateStore(tmp_path).measured_contention("Unknown GPU") is None


@pytest.mark.parametrize("text", ["{not json", '{"version": 2, "gpus": {}}', '{"version": 1}', "[]"])
def test_an_unmergeable_file_is_refused_not_overwritten(tmp_path: Path, text: str) -> None:
    path = contention_path(tmp_path)
    path.write_text(text)
    with pytest.raises(ContentionFileError, match="fix or move it away"):
        write_entry(path, GPU, make_entry(0.5, 0.5, "c", None))
    assert path.read_text() == text
    assert StateStore(tmp_path).measured_contention(GPU) is None  # and the daemon slices as one domain


def test_a_write_cut_short_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = contention_path(tmp_path)
    write_entry(path, GPU, make_entry(0.5, 0.5, "first", None))
    before = path.read_text()

    def crash(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space"):
        write_entry(path, GPU, make_entry(0.9, 0.9, "second", None))
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["contention.json"]


def test_the_daemon_refuses_a_hand_edited_nan(tmp_path: Path) -> None:
    contention_path(tmp_path).write_text('{"version": 1, "gpus": {"Test GPU": {"compute_kept": NaN, '
                                         '"graphics_kept": 0.9}}}')
    assert StateStore(tmp_path).measured_contention(GPU) is None


# ------------------------------------------------------------------------------------ the command


def calibrate(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "unisched", "calibrate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=child_env())


def standins(cuda: str = f"{STANDIN} --kind cuda --item-ms 5", render: str = f"{STANDIN} --kind render --item-ms 5") -> list[str]:
    """Paced CPU stand-ins: rates a busy host hardly moves, so the fractions stay inside the accepted range."""
    return ["--gpu-name", GPU, "--seconds", "1", "--warmup", "0.5", "--workload-cmd-cuda", cuda,
            "--workload-cmd-render", render]


def test_calibrate_writes_where_the_daemon_reads(tmp_path: Path) -> None:
    """The target is the state_dir knob's, from the same config file and flag `serve` takes."""
    state = tmp_path / "state"
    config = tmp_path / "unisched.toml"
    config.write_text(f'[daemon]\nstate_dir = "{state}"\n')
    done = calibrate("--config", str(config), "--work-dir", str(tmp_path / "work"), *standins())
    assert done.returncode == 0, done.stderr
    kept = StateStore(state).measured_contention(GPU)
    assert kept is not None and all(0.0 < k <= MAX_KEPT for k in kept)
    assert f"wrote {state / 'contention.json'}" in done.stdout and "verdict: " in done.stdout
    assert "[3/3] both together, no scheduler" in done.stderr and "left)" in done.stderr  # progress
    entry = json.loads((state / "contention.json").read_text())["gpus"][GPU]
    assert entry["command"].startswith("unisched calibrate --config")


def test_a_failed_run_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    write_entry(out, GPU, make_entry(0.5, 0.5, "before", None))
    before = out.read_text()
    done = calibrate("--out", str(out), *standins(render=f"{sys.executable} -c 'raise SystemExit(3)'"))
    assert done.returncode == 1
    assert "nothing written" in done.stderr and "render: no report written; exit status 3" in done.stderr
    assert out.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_an_unwritable_target_is_refused_before_measuring(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    out.write_text("{broken")
    done = calibrate("--out", str(out), "--work-dir", str(tmp_path / "w"), *standins())
    assert done.returncode == 2 and "fix or move it away" in done.stderr
    assert not (tmp_path / "w").exists() and out.read_text() == "{broken"


def test_dry_run_says_the_plan_and_runs_nothing(tmp_path: Path) -> None:
    done = calibrate("--out", str(tmp_path / "c.json"), "--quick", "--dry-run")
    assert done.returncode == 0
    assert "render calibration" in done.stderr and f"about {estimate_s(QUICK):.0f} s" in done.stderr
    assert not (tmp_path / "c.json").exists()


def test_help_says_when_to_run_it() -> None:
    done = calibrate("--help")
    assert done.returncode == 0
    for words in ("once per GPU model", "driver update", "restart the daemon", "--quick", "exit status"):
        assert words in " ".join(done.stdout.split())


def _nvml_gpu() -> bool:
    from unisched.telemetry.nvml import open_nvml_or_reason

    nvml, _ = open_nvml_or_reason()
    if nvml is None:
        return False
    try:
        return bool(nvml.gpus())
    finally:
        nvml.close()


@pytest.mark.skipif(_nvml_gpu(), reason="this machine has an NVIDIA GPU: the refusal needs one without")
def test_without_a_gpu_it_refuses_and_says_why(tmp_path: Path) -> None:
    done = calibrate("--out", str(tmp_path / "c.json"), "--quick")
    assert done.returncode == 2
    assert NO_GPU in done.stderr
    assert list(tmp_path.iterdir()) == []
