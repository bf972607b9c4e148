"""Running the calibration's workloads: each in its own process group, several started together over one window.

The workloads (a CUDA matmul load and an EGL render load, or replacements with the same arguments) take
`--seconds S --warmup W --start-at EPOCH --report PATH` and write a JSON report with their throughput and a timeline
of their window. Launching both with the same `--start-at` makes them measure the same seconds, so neither measures
while the other is still starting.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unisched.calibrate.fit import Measured

__all__ = ["RENDER_CALIBRATION_TIMEOUT_S", "RunResult", "Workload", "calibrate_render", "kill_group", "read_report",
           "run_together"]

RENDER_CALIBRATION_TIMEOUT_S = 90.0
"""The render load's own frame-rate search takes about 10 s on a GPU; far past that it is stuck (no EGL device)."""
STOP_GRACE_S = 3.0
"""How long a workload past its deadline has to exit on SIGTERM before SIGKILL (CUDA teardown takes a moment)."""
LOG_TAIL_CHARS = 1500


@dataclass(frozen=True)
class Workload:
    """One workload to launch: its kind ("cuda" or "render") and its command, window arguments appended."""

    kind: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class RunResult:
    """One run: what each workload measured, or why it did not."""

    label: str
    measured: tuple[Measured, ...]
    errors: tuple[str, ...]
    reports: tuple[Mapping[str, Any], ...]

    @property
    def ok(self) -> bool:
        return not self.errors


def read_report(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The workload's JSON report, or why there is none."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, "no report written"
    except (OSError, ValueError) as exc:
        return None, f"unreadable report: {exc}"
    return (data, None) if isinstance(data, dict) else (None, "the report is not a JSON object")


def kill_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """Stop a child we started, and its own children (it leads its own session)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-LOG_TAIL_CHARS:].decode(errors="replace").strip()
    except OSError:
        return ""


def _measured(kind: str, report: Mapping[str, Any]) -> Measured:
    window = report.get("window") or {}
    timeline = tuple((float(t), float(n)) for t, n in window.get("timeline") or [])
    return Measured(kind, float(report["throughput"]), timeline)


def run_together(label: str, workloads: Sequence[Workload], seconds: float, warmup: float, grace_s: float,
                 work_dir: Path, env: Mapping[str, str]) -> RunResult:
    """Launch the workloads back to back, all measuring the window that starts `warmup` s from now and lasts
    `seconds`; wait until each has exited (at most `grace_s` past the window, then it is killed); read the reports."""
    run_dir = work_dir / re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    run_dir.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + warmup
    procs: list[tuple[Workload, subprocess.Popen[bytes], Path, Path]] = []
    try:
        for n, w in enumerate(workloads):
            report_path, log = run_dir / f"{n}-{w.kind}.json", run_dir / f"{n}-{w.kind}.log"
            report_path.unlink(missing_ok=True)
            argv = [*w.argv, "--seconds", f"{seconds:g}", "--warmup", f"{warmup:g}", "--start-at", f"{start_at:.3f}",
                    "--report", str(report_path)]
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                        start_new_session=True)
            procs.append((w, proc, report_path, log))
        deadline = time.monotonic() + warmup + seconds + grace_s
        for _, proc, _, _ in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for _, proc, _, _ in procs:
            kill_group(proc)
    measured: list[Measured] = []
    errors: list[str] = []
    reports: list[dict[str, Any]] = []
    for w, proc, report_path, log in procs:
        report, missing = read_report(report_path)
        why = "; ".join(filter(None, (missing, "" if proc.returncode == 0 else f"exit status {proc.returncode}")))
        if report is not None and not why:
            try:
                measured.append(_measured(w.kind, report))
                reports.append(report)
                continue
            except (KeyError, TypeError, ValueError) as exc:
                why = f"report without a throughput and timeline: {exc!r}"
        errors.append(f"{label}: {w.kind}: {why}" + (f"\n{_tail(log)}" if _tail(log) else ""))
    return RunResult(label, tuple(measured), tuple(errors), tuple(reports))


def calibrate_render(render: Workload, target_fps: float, work_dir: Path, env: Mapping[str, str]) -> tuple[int, float]:
    """The render load's --iterations that give about `target_fps` frames/s alone (frames ~1/target_fps long, as in
    the sharing benchmark), and the rate it measured; RuntimeError when it fails."""
    report, log = work_dir / "render-calibration.json", work_dir / "render-calibration.log"
    report.unlink(missing_ok=True)
    argv = [*render.argv, "--calibrate-fps", f"{target_fps:g}", "--report", str(report)]
    with log.open("wb") as out:
        try:
            rc: int | None = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=dict(env),
                                            timeout=RENDER_CALIBRATION_TIMEOUT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = None
    data, missing = read_report(report)
    if rc != 0 or data is None:
        raise RuntimeError(f"render calibration failed ({missing or f'exit status {rc}'}): {_tail(log)}")
    return int(data["iterations"]), float(data["fps"])
