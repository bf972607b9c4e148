"""What gpu_pairs.py prepares before it measures, and the contention calibration it can write.

The render workload's --iterations for a frame rate alone (--render-fps), the NVDEC test clip made once before the
first run, and with --calibrate-out DIR: DIR/contention.json as `unisched calibrate` writes it
(unisched.scheduler.contention_file owns the format; the daemon reads it at start and derives its map with
unisched.policy.contention.ContentionMap.from_kept), from the round's alone and no-scheduler cuda+render runs.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

from _daemon import ROOT
from pairs_plan import WORKLOADS, Pair, solo_kinds
from pairs_runs import LOG_TAIL_CHARS, Config, GroupResult, Progress, read_report, tail

from unisched.calibrate.fit import CalibrationError, Measured
from unisched.calibrate.fit import kept_fractions as fit_kept_fractions
from unisched.scheduler.contention_file import ContentionFileError, contention_path, read_file, write_entry

CLIP_TIMEOUT_S = 300.0


CLIP_CODE = ("import pathlib, runpy, sys; sys.path.insert(0, str(pathlib.Path(sys.argv[1]).parent)); "
             "g = runpy.run_path(sys.argv[1]); clip = g['DEFAULT_CLIP']; "
             "print(clip); print('kept' if clip.exists() else 'made with ' + g['make_clip'](clip))")
"""Run with the NVDEC example's path: its test clip (DEFAULT_CLIP), made by its make_clip where it is not there yet
(on the CPU: a run that made it would spend its window on it); prints the clip's path, then how it came to be."""


def calibrate_render(cfg: Config, target_fps: float) -> dict[str, Any]:
    """Find the render --iterations giving ~target_fps alone, so frames stay ~1/target_fps long."""
    report_path = cfg.work_dir / "render-calibration.json"
    log = cfg.work_dir / "render-calibration.log"
    argv = [*cfg.workload_cmd["render"], "--calibrate-fps", f"{target_fps:g}",
            "--report", str(report_path)]
    with log.open("wb") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=cfg.env, timeout=90)
            rc: int | None = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
    report, error = read_report(report_path)
    return {"argv": argv, "rc": rc, "report": report, "error": error if rc == 0 else
            f"calibration failed (rc {rc}): {tail(log, 1500)}"}


def render_calibration_wanted(cfg: Config, render_fps: float, render_iterations: int | None) -> bool:
    """Calibrate the real render workload unless it is replaced, given fixed iterations, or fps is 0.

    Fixed iterations are applied to cfg here (the real workload only: a replacement gets none).
    """
    if render_iterations is not None and not cfg.custom_cmd["render"]:
        cfg.kind_args["render"] = ["--iterations", str(render_iterations)]
    return not cfg.custom_cmd["render"] and render_iterations is None and render_fps > 0


def render_iterations_used(cfg: Config) -> int | None:
    """The --iterations every render run gets (None: the workload's default, or a replacement command)."""
    extra = cfg.kind_args.get("render", [])
    return int(extra[extra.index("--iterations") + 1]) if "--iterations" in extra else None


def prepare_clip(cfg: Config, pairs: list[Pair], progress: Progress) -> str | None:
    """Have the NVDEC test clip before the first run (CLIP_CODE: the example's own, made once and kept across runs and
    rounds) and give it to every NVDEC run. Returns why it could not be had; None where it was, or where no run
    decodes with the example (a replacement command)."""
    if "nvdec" not in solo_kinds(pairs) or cfg.custom_cmd["nvdec"]:
        return None
    t0 = time.monotonic()
    try:
        done = subprocess.run([cfg.python, "-c", CLIP_CODE, str(WORKLOADS["nvdec"])], capture_output=True,
                              text=True, cwd=ROOT, env=cfg.env, timeout=CLIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"making the NVDEC test clip took over {CLIP_TIMEOUT_S:g} s"
    path, _, how = done.stdout.strip().partition("\n")
    if done.returncode != 0 or not path or not Path(path).is_file():
        return f"making the NVDEC test clip failed (rc {done.returncode}): {done.stderr.strip()[-LOG_TAIL_CHARS:]}"
    cfg.kind_args["nvdec"] = ["--clip", path]
    progress.note(f"NVDEC test clip {path}: {how} ({time.monotonic() - t0:.0f} s)")
    return None


def prepare_render(cfg: Config, render_fps: float, progress: Progress) -> tuple[dict[str, Any], int | None]:
    """Run the render calibration; on success use its --iterations for every later render run.

    Returns the calibration record and the iterations (None when it failed: render runs are then skipped).
    """
    progress.step(f"render calibration to ~{render_fps:g} frames/s alone")
    cal = calibrate_render(cfg, render_fps)
    if cal["report"] and cal["rc"] == 0:
        iters = int(cal["report"]["iterations"])
        cfg.kind_args["render"] = ["--iterations", str(iters)]
        progress.note(f"  -> --iterations {iters} ({cal['report']['fps']:.1f} frames/s)")
        return cal, iters
    progress.note(f"  -> FAILED: {cal['error']}")
    return cal, None


def gpu0_name() -> str | None:
    """GPU 0's name exactly as `nvidia-smi --query-gpu=name` prints it (NVML's name: the daemon's key), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return lines[0] if done.returncode == 0 and lines else None


def _measured(group: GroupResult, kind: str) -> Measured:
    """The run's first tenant of this kind, as the calibration's fit takes it."""
    for t in group.tenants:
        if t.kind == kind and t.throughput is not None:
            timeline = ((t.report or {}).get("window") or {}).get("timeline") or []
            return Measured(kind, t.throughput, tuple((float(a), float(b)) for a, b in timeline))
    raise ContentionFileError(f"{group.setup} {group.label}: no {kind} throughput")


def kept_fractions(solo_cuda: GroupResult, solo_render: GroupResult,
                   together: GroupResult) -> tuple[float, float]:
    """(compute_kept, graphics_kept) = throughput together (over the seconds both ran) / alone: `unisched
    calibrate`'s fit (unisched.calibrate.fit) of these runs."""
    shared = [_measured(together, "cuda"), _measured(together, "render")]
    try:
        return fit_kept_fractions(_measured(solo_cuda, "cuda"), _measured(solo_render, "render"), shared)
    except CalibrationError as exc:
        raise ContentionFileError(str(exc)) from exc


def device_warnings(gpu: str, groups: list[GroupResult]) -> list[str]:
    """Reports that name a device other than the GPU the calibration is filed under (real workloads only)."""
    out = []
    for group in groups:
        for t in group.tenants:
            rep = t.report or {}
            for key in ("device_name", "gl_renderer"):  # cuda_matmul.py: torch's name; egl_render.py: GL's
                seen = rep.get(key)
                if seen is not None and not str(seen).startswith(gpu):
                    out.append(f"{group.setup} {group.label} / {t.name}: ran on {seen!r}, but the calibration "
                               f"is filed under {gpu!r}")
    return out


def check_contention_dir(state_dir: Path) -> None:
    """Fail before any measuring if the file could not be written or merged later."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ContentionFileError(f"cannot create {state_dir}: {exc}") from exc
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise ContentionFileError(f"{state_dir} is not writable (the daemon's default needs root)")
    read_file(contention_path(state_dir))


def write_contention_file(state_dir: Path, gpu: str, entry: dict[str, Any]) -> Path:
    """Merge `entry` for `gpu` into STATE_DIR/contention.json (other GPUs kept), atomically."""
    path = contention_path(state_dir)
    write_entry(path, gpu, entry)
    return path
