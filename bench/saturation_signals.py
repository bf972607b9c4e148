#!/usr/bin/env python3
"""Which GPU signal tells a saturated GPU from a busy-looking one: NVML utilization and GPM metrics, sampled
while workloads run with no scheduler.

Why: freezer enforcement slices only while a GPU is saturated (unisched/policy/saturation.py). NVML's utilization
(time with any kernel running) read 0.9+ for sixteen paced cloud-gaming instances that left the GPU idle most
of the time; GPM's SM busy fraction fixed that case but stayed under the threshold for a training + heavy-render
pair that contends hard (training fell to 0.20 of its solo rate). This tool records every candidate signal for
such loads side by side, so the threshold and the metric are chosen from measurements.

  python3 bench/saturation_signals.py --out DIR \\
      --phase "render=python3 examples/03_egl_render.py --iterations 447 --seconds 12 --warmup 0" \\
      --phase "cloud16=python3 examples/cloud_gaming.py --instances 16 --seconds 12 --out /tmp/cg16"

Each phase runs its command to the end while a sampler reads the metrics every --every seconds (after
--skip seconds of start-up); the summary is the median and p90 of each metric per phase (results.json/.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

GPM_METRICS = {"graphics_util": 1, "sm_util": 2, "sm_occupancy": 3, "any_tensor_util": 5, "dram_bw_util": 10,
               "fp32_util": 12, "fp16_util": 13}
SUMMARY_KEYS = ["nvml_util", *GPM_METRICS, "proc_sm_sum", "proc_sm_max"]


def process_sm_util(nvml: Any, handle: Any, since: int) -> tuple[dict[int, float], int]:
    """NVML's per-process SM utilization (percent) since `since` (microseconds), and the newest timestamp.
    Lists graphics and codec processes on the H200, not PyTorch ones (DESIGN.md)."""
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
    except nvml.NVMLError:
        return {}, since
    out: dict[int, float] = {}
    newest = since
    for s in samples:
        if s.timeStamp > since:
            out[int(s.pid)] = max(out.get(int(s.pid), 0.0), float(s.smUtil))
            newest = max(newest, int(s.timeStamp))
    return out, newest


def sample_loop(nvml: Any, handle: Any, every: float, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    prev, nxt = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    nvml.nvmlGpmSampleGet(handle, prev)
    since = 0
    while not stop.wait(every):
        nvml.nvmlGpmSampleGet(handle, nxt)
        m = nvml.c_nvmlGpmMetricsGet_t()
        m.version = nvml.NVML_GPM_METRICS_GET_VERSION
        m.numMetrics = len(GPM_METRICS)
        m.sample1, m.sample2 = prev, nxt
        for i, mid in enumerate(GPM_METRICS.values()):
            m.metrics[i].metricId = mid
        nvml.nvmlGpmMetricsGet(m)
        row: dict[str, Any] = {"t": time.monotonic(), "nvml_util": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)}
        for i, name in enumerate(GPM_METRICS):
            if m.metrics[i].nvmlReturn == nvml.NVML_SUCCESS:
                row[name] = round(float(m.metrics[i].value), 2)
        procs, since = process_sm_util(nvml, handle, since)
        row["proc_sm"] = procs
        if procs:
            row["proc_sm_sum"] = sum(procs.values())
            row["proc_sm_max"] = max(procs.values())
        out.append(row)
        prev, nxt = nxt, prev


def saturated_windows(values: list[float], n: int, threshold: float) -> float:
    """Fraction of the windows of n consecutive samples whose mean is >= threshold (what freezer enforcement's
    saturation gate asks of its per-slice busy fraction)."""
    if n < 1 or len(values) < n:
        return 0.0
    hits = sum(1 for i in range(len(values) - n + 1) if sum(values[i:i + n]) >= threshold * n - 1e-9)
    return hits / (len(values) - n + 1)


def run_phase(nvml: Any, handle: Any, name: str, command: str, every: float, skip: float,
              window: float = 0.2, threshold: float = 98.0) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_loop, args=(nvml, handle, every, stop, rows), daemon=True)
    t0 = time.monotonic()
    sampler.start()
    proc = subprocess.run(shlex.split(command), capture_output=True, text=True)
    stop.set()
    sampler.join()
    kept = [r for r in rows if r["t"] - t0 >= skip]
    summary: dict[str, Any] = {"phase": name, "command": command, "rc": proc.returncode, "samples": len(kept),
                               "tail": (proc.stdout + proc.stderr)[-600:]}
    per_pid: dict[int, list[float]] = {}
    for r in kept:
        for pid, v in r.get("proc_sm", {}).items():
            per_pid.setdefault(pid, []).append(v)
    summary["proc_sm_median_by_pid"] = {str(pid): statistics.median(v) for pid, v in sorted(per_pid.items())}
    n = max(1, round(window / every))
    for key in SUMMARY_KEYS:
        series = [r[key] for r in kept if key in r]
        values = sorted(series)
        if values:
            summary[key] = {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))],
                            "p10": values[int(0.1 * (len(values) - 1))],
                            "saturated_windows": round(saturated_windows(series, n, threshold), 3)}
    summary["series"] = [{k: r[k] for k in ("t", "nvml_util", "graphics_util") if k in r} for r in kept]
    print(f"saturation_signals: {name}: " + ", ".join(
        f"{k} {summary[k]['median']:.0f}/{summary[k]['p90']:.0f}" for k in SUMMARY_KEYS if k in summary), flush=True)
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", action="append", required=True, metavar="NAME=COMMAND",
                    help="a workload to run and sample (repeatable; run in order, one at a time)")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples (default 0.25)")
    ap.add_argument("--skip", type=float, default=6.0, help="seconds of start-up not sampled (default 6)")
    ap.add_argument("--window", type=float, default=0.2,
                    help="seconds over which a mean busy fraction >= --threshold counts as saturated (default 0.2)")
    ap.add_argument("--threshold", type=float, default=98.0, help="percent (default 98)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    phases = []
    for p in args.phase:
        name, sep, command = p.partition("=")
        if not sep or not name or not command.strip():
            ap.error(f"--phase must be NAME=COMMAND, got {p!r}")
        phases.append((name, command))
    try:
        import pynvml as nvml
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(args.gpu)
        if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            print("error: this GPU has no GPM metrics (Hopper or later needed)", file=sys.stderr)
            return 2
    except Exception as e:
        print(f"error: NVML/GPM not usable here: {e}", file=sys.stderr)
        return 2
    results = [run_phase(nvml, handle, name, cmd, args.every, args.skip, args.window, args.threshold)
               for name, cmd in phases]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python3 bench/saturation_signals.py " + shlex.join(sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "gpu": str(nvml.nvmlDeviceGetName(handle))}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "phases": results}, indent=1) + "\n")
    keys = SUMMARY_KEYS
    md = [f"Command: `{meta['command']}` | {meta['date_utc']} UTC | {meta['gpu']}", "",
          "Median / p90 over the run (percent), start-up skipped:", "",
          "| phase | rc | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for r in results:
        cells = [f"{r[k]['median']:.0f} / {r[k]['p90']:.0f}" if k in r else "" for k in keys]
        md.append(f"| {r['phase']} | {r['rc']} | " + " | ".join(cells) + " |")
    md += ["", f"Share of {args.window:g} s windows whose mean is >= {args.threshold:g}% (the gate's saturation test), "
           "and p10 (percent):", ""]
    md += [f"- {r['phase']}: " + "; ".join(f"{k} {r[k]['saturated_windows']:.2f} (p10 {r[k]['p10']:.1f})"
                                           for k in ("nvml_util", "graphics_util") if k in r) for r in results]
    md += ["", "Per-process SM utilization (NVML, median percent per pid; PyTorch processes are not listed):", ""]
    md += [f"- {r['phase']}: " + ", ".join(f"{v:.0f}" for v in r["proc_sm_median_by_pid"].values()) for r in results]
    (args.out / "results.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
