"""`unisched calibrate`: measure how much CUDA and rendering slow each other on GPU 0, and file it for the daemon.

Steps: (1) the render load finds the iterations per frame that give about 36 frames/s alone, (2) the CUDA load
alone, (3) the render load alone, (4) both together with no scheduler. compute_kept = CUDA's rate together / alone,
graphics_kept = the render's. The two numbers are checked and merged into the contention file under GPU 0's NVML
name (the key the daemon looks up at start), atomically. Nothing is written when a step fails.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from unisched.calibrate.fit import CalibrationError, kept_fractions, verdict_line
from unisched.calibrate.runs import RunResult, Workload, calibrate_render, run_together
from unisched.policy.tuning import TUNING
from unisched.scheduler.contention_file import MAX_KEPT, ContentionFileError, make_entry, read_file, write_entry

__all__ = ["EXIT_FAILED", "EXIT_REFUSED", "NO_GPU", "QUICK", "STANDARD", "Request", "Timing", "estimate_s", "main", "plan_steps",
           "workload_dir"]

EXIT_FAILED = 1
"""A measurement failed or gave numbers outside their range: nothing written."""
EXIT_REFUSED = 2
"""Refused before measuring: no GPU, no workloads, a target it could not write."""
NO_GPU = "no NVIDIA GPU found: calibration measures contention between GPU engines on a real GPU"
RENDER_FPS = 36.0
"""The render load's frame rate alone: frames of ~28 ms, the game-like load the sharing benchmark runs (a few
frames per 50 ms slice), so the fractions describe the pairs the daemon schedules."""
RENDER_CALIBRATION_S = 10.0
"""What the render calibration step takes, for the time estimate."""
RUN_OVERHEAD_S = 2.0
"""Per run, beyond warm-up and window: process exit and reading the reports (for the time estimate)."""
NEAR_THRESHOLD = 0.05
"""A kept fraction this close to a threshold of the verdict is worth measuring again with a longer window."""


@dataclass(frozen=True)
class Timing:
    """How long each run measures, after how much start-up."""

    seconds: float
    """Measured window per run: the CUDA load's rate varies a few percent over seconds (clocks, power)."""
    warmup: float
    """From launch to the window: PyTorch's import and cuBLAS set-up take 3-5 s before its first matmul."""
    grace_s: float = 20.0
    """How long a run may overrun its window before it is killed."""


STANDARD = Timing(seconds=10.0, warmup=5.0)
QUICK = Timing(seconds=3.0, warmup=5.0, grace_s=15.0)
"""For checking the set-up (and the GPU test): the fractions are noisier than STANDARD's."""


@dataclass(frozen=True)
class Request:
    """What `unisched calibrate` was asked (cli parses the flags into this)."""

    out: Path
    """The contention file to merge into: the daemon's STATE_DIR/contention.json unless --out says otherwise."""
    timing: Timing = STANDARD
    gpu_name: str | None = None
    """File under this name instead of GPU 0's NVML name."""
    cuda_cmd: tuple[str, ...] | None = None
    """Replaces the CUDA load (e.g. a CPU stand-in when checking the pipeline without a GPU)."""
    render_cmd: tuple[str, ...] | None = None
    render_iterations: int | None = None
    """Fixed render iterations per frame, skipping the render calibration step."""
    work_dir: Path | None = None
    dry_run: bool = False
    command: str = "unisched calibrate"
    """As recorded in the entry."""


def workload_dir() -> Path:
    """Where the CUDA and render loads live: examples/workloads of the unisched source tree."""
    return Path(__file__).resolve().parents[2] / "examples" / "workloads"


def _workloads(req: Request) -> tuple[Workload, Workload]:
    here = workload_dir()
    cuda = req.cuda_cmd or (sys.executable, str(here / "cuda_matmul.py"))
    render = req.render_cmd or (sys.executable, str(here / "egl_render.py"))
    return Workload("cuda", tuple(cuda)), Workload("render", tuple(render))


def estimate_s(timing: Timing, calibrates_render: bool = True) -> float:
    """About how long a calibration with these windows takes."""
    return (RENDER_CALIBRATION_S if calibrates_render else 0.0) + 3 * (timing.warmup + timing.seconds + RUN_OVERHEAD_S)


def plan_steps(req: Request) -> list[tuple[str, float]]:
    """(what, estimated seconds) for each step, in order."""
    run_s = req.timing.warmup + req.timing.seconds + RUN_OVERHEAD_S
    steps = [] if not _calibrates_render(req) else [(f"render calibration to ~{RENDER_FPS:g} frames/s", RENDER_CALIBRATION_S)]
    return [*steps, ("CUDA load alone", run_s), ("render load alone", run_s), ("both together, no scheduler", run_s)]


def _calibrates_render(req: Request) -> bool:
    return req.render_cmd is None and req.render_iterations is None


class Progress:
    """'[k/N] what (~S s; about T s left)' lines on stderr: the calibration takes about a minute."""

    def __init__(self, steps: list[tuple[str, float]], out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.steps, self.out, self.clock, self.done = steps, out, clock, 0
        self.t0 = clock()

    def step(self) -> None:
        what, est = self.steps[self.done]
        self.done += 1
        left = sum(s for _, s in self.steps[self.done - 1:])
        self.say(f"[{self.done}/{len(self.steps)}] {what} (~{est:.0f} s; about {left:.0f} s left)")

    def say(self, text: str) -> None:
        print(f"calibrate +{self.clock() - self.t0:4.0f}s {text}", file=self.out, flush=True)


def _gpu_name() -> tuple[str | None, str]:
    """(GPU 0's NVML name: the key the daemon looks up, "") or (None, why there is none)."""
    from unisched.telemetry.nvml import open_nvml_or_reason

    nvml, reason = open_nvml_or_reason()
    if nvml is None:
        return None, reason
    try:
        gpus = nvml.gpus()
        return (gpus[0].name, "") if gpus else (None, "NVML lists no usable GPU")
    finally:
        nvml.close()


def _preflight(req: Request) -> tuple[str | None, str | None]:
    """(the GPU name to file under, None) or (None, why calibration is refused): checked before a minute of
    measuring."""
    real = req.cuda_cmd is None or req.render_cmd is None
    name, why = _gpu_name() if real or req.gpu_name is None else (None, "")
    gpu = req.gpu_name or name
    if gpu is None or (real and name is None):
        return None, f"{NO_GPU} ({why})"
    needs = [(req.cuda_cmd is None, "torch", "PyTorch with CUDA (pip install torch)"),
             (req.render_cmd is None, "OpenGL", "PyOpenGL (pip install 'unisched[gl]')")]
    missing = [what for wanted, module, what in needs if wanted and importlib.util.find_spec(module) is None]
    if missing:
        return None, "the calibration workloads need " + " and ".join(missing)
    if real and not (workload_dir() / "cuda_matmul.py").is_file():
        return None, f"the calibration workloads are not at {workload_dir()} (they ship in the unisched source tree)"
    try:
        read_file(req.out)  # a file we could not merge into is refused now, not after a minute of measuring
        req.out.parent.mkdir(parents=True, exist_ok=True)
    except (ContentionFileError, OSError) as exc:
        return None, str(exc)
    if not os.access(req.out.parent, os.W_OK | os.X_OK):
        return None, f"{req.out.parent} is not writable (the daemon's state dir needs root)"
    return gpu, None


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("PYOPENGL_PLATFORM", "egl")  # render with no display
    return env


def measure(req: Request, progress: Progress, work_dir: Path) -> tuple[tuple[float, float], int | None, list[RunResult]]:
    """Run the steps; ((compute_kept, graphics_kept), render iterations used, the runs). CalibrationError when a
    step failed."""
    cuda, render = _workloads(req)
    env = _env()
    iterations = req.render_iterations
    if _calibrates_render(req):
        progress.step()
        try:
            iterations, fps = calibrate_render(render, RENDER_FPS, work_dir, env)
        except (RuntimeError, KeyError, ValueError) as exc:
            raise CalibrationError(str(exc)) from exc
        progress.say(f"  -> --iterations {iterations} ({fps:.1f} frames/s)")
    if iterations is not None:
        render = replace(render, argv=(*render.argv, "--iterations", str(iterations)))
    t = req.timing
    runs = []
    for label, workloads in (("cuda alone", [cuda]), ("render alone", [render]), ("together", [cuda, render])):
        progress.step()
        run = run_together(label, workloads, t.seconds, t.warmup, t.grace_s, work_dir, env)
        runs.append(run)
        if not run.ok:
            raise CalibrationError("\n".join(run.errors))
        progress.say("  -> " + ", ".join(f"{m.kind} {m.throughput:.1f}/s" for m in run.measured))
    kept = kept_fractions(runs[0].measured[0], runs[1].measured[0], runs[2].measured)
    return kept, iterations, runs


def _device_warnings(gpu: str, runs: list[RunResult]) -> list[str]:
    """Reports naming a device other than the GPU the calibration is filed under."""
    seen = {str(r.get(k)) for run in runs for r in run.reports for k in ("device_name", "gl_renderer") if r.get(k)}
    return [f"a workload ran on {s!r}, but the result is filed under {gpu!r}" for s in sorted(seen)
            if not s.startswith(gpu)]


def summary(gpu: str, kept: tuple[float, float], out: Path, warnings: list[str]) -> str:
    compute, graphics = kept
    lines = [f"contention on GPU 0 ({gpu}): compute kept {compute:.2f}, graphics kept {graphics:.2f} "
             f"(sum {compute + graphics:.2f})", "verdict: " + verdict_line(compute, graphics)]
    near = [x for x, v in ((TUNING.overlap_kept, min(kept)), (TUNING.mix_sum, sum(kept))) if abs(v - x) < NEAR_THRESHOLD]
    if near:
        lines.append(f"  note: within {NEAR_THRESHOLD:g} of the threshold {near[0]:g}: measure again with the "
                     "standard windows (no --quick) before trusting the verdict")
    lines.append(f"wrote {out}")
    lines.append("the daemon reads it at start: restart `unisched serve` to use it")
    return "\n".join([*lines, *(f"warning: {w}" for w in warnings)]) + "\n"


def main(req: Request, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run `unisched calibrate`; the exit status."""
    steps = plan_steps(req)
    progress = Progress(steps, err)
    progress.say(f"plan: {'; '.join(s for s, _ in steps)}: about {sum(s for _, s in steps):.0f} s; writes {req.out}")
    if req.dry_run:
        return 0
    gpu, refused = _preflight(req)
    if gpu is None:
        print(f"unisched calibrate: {refused}", file=err)
        return EXIT_REFUSED
    work_dir = req.work_dir or Path(tempfile.mkdtemp(prefix="unisched-calibrate-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    progress.say(f"measuring on {gpu}; workload logs and reports in {work_dir}")
    try:
        kept, iterations, runs = measure(req, progress, work_dir)
        entry = make_entry(*kept, req.command, iterations)
        write_entry(req.out, gpu, entry)
    except (CalibrationError, ContentionFileError, OSError) as exc:
        print(f"unisched calibrate: nothing written: {exc}", file=err)
        if isinstance(exc, ContentionFileError) and "within" in str(exc):
            print(f"unisched calibrate: kept fractions above {MAX_KEPT:g} mean a solo run measured something else "
                  "(another process on the GPU?): measure again on an idle GPU", file=err)
        return EXIT_FAILED
    out.write(summary(gpu, (entry["compute_kept"], entry["graphics_kept"]), req.out,
                      _device_warnings(gpu, runs)))
    return 0
