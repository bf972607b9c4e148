#!/usr/bin/env python3
"""Measure how much CUDA and rendering slow each other on GPU 0; write the daemon's contention file.

Why: whether compute and graphics overlap in hardware is workload-dependent on the H200 (the pair
benchmark of 2026-11-30 saw CUDA keep 0.14 of its solo rate next to rendering, render 0.87; an earlier
probe saw CUDA keep 0.55-0.95). So the daemon does not assume it: it reads STATE_DIR/contention.json at
start and slices compute and graphics as one domain unless a calibration on that GPU model says they
overlap (unisched/policy/contention.py, ContentionMap.from_kept; bench/scoring.py, contention_verdict).

What it runs, with bench/gpu_pairs.py's machinery (same workloads, same aligned windows, same reports):
the render calibration (or --render-iterations), the CUDA load alone, the render load alone, then both
together with no scheduler. compute_kept = CUDA together / alone, graphics_kept = render together / alone.
The entry for this GPU (keyed by its nvidia-smi name) is merged into STATE_DIR/contention.json, other GPUs'
entries kept, written atomically. bench/gpu_pairs.py --calibrate-out DIR writes the same file from its
own runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_pairs as gp
import scoring

DEFAULT_STATE_DIR = Path("/var/lib/unisched")
NEAR_THRESHOLD = 0.05  # a kept fraction this close to scoring.OVERLAP_KEPT is worth measuring again


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Calibrate the contention between CUDA and rendering on GPU 0 for the unisched daemon: "
                    "the CUDA load alone, the render load alone, both together with no scheduler; writes "
                    "compute_kept and graphics_kept (together / alone) for this GPU into "
                    "STATE_DIR/contention.json, which the daemon reads at start.",
        epilog=f"""verdict (what the daemon derives; bench/scoring.py contention_verdict):
  separate-graphics  both kept >= {scoring.OVERLAP_KEPT:g}: compute and graphics overlap, not sliced against each other
  partial-overlap    the two kept sum to >= {scoring.MIX_SUM:g}: mixed slices (together part of the time, each alone
                     as its weight share needs; unisched/policy/overlap.py)
  shared-sm          otherwise: they contend, and are sliced against each other as one domain

time: render calibration (~10 s) + 3 runs of warmup + seconds (+ ~3 s): about 65 s by default.

on the GPU machine (carry .devcache; as root for the default --state-dir):
  source .devcache/setup.sh && python3 bench/calibrate_contention.py
  then restart `unisched serve` so it reads the file (it is read once, at start).

without a GPU (checks the pipeline with CPU stand-ins; pinned to two CPUs they overlap):
  python3 bench/calibrate_contention.py --seconds 2 --warmup 0.5 --state-dir /tmp/us-state \\
    --gpu-name "Test GPU" \\
    --workload-cmd-cuda "python3 bench/cpu_standin.py --kind cuda --pin-cpu 0" \\
    --workload-cmd-render "python3 bench/cpu_standin.py --kind render --pin-cpu 1"

exit status: 0 when the file was written, 1 when a run failed (nothing written), 2 for bad arguments
or a state dir / GPU name it cannot use (checked before measuring).""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, metavar="DIR",
                        help=f"the daemon's state dir; writes DIR/{gp.CONTENTION_FILE} (default: {DEFAULT_STATE_DIR})")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per run (default: 10)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds from launch to the window's start (default: 5)")
    parser.add_argument("--render-fps", type=float, default=36.0,
                        help="calibrate the render load alone to about this many frames/s first, as "
                             "gpu_pairs.py does (default: 36)")
    parser.add_argument("--render-iterations", type=int, default=None,
                        help="fixed egl_render.py --iterations; skips the render calibration")
    parser.add_argument("--gpu-name", default=None, metavar="NAME",
                        help="the GPU name to file the result under (default: GPU 0's name from nvidia-smi "
                             "--query-gpu=name, which is what the daemon looks up)")
    parser.add_argument("--workload-cmd-cuda", default=None, metavar="CMD",
                        help="command replacing examples/workloads/cuda_matmul.py (shell words; the window "
                             "arguments are appended), e.g. a CPU stand-in for testing")
    parser.add_argument("--workload-cmd-render", default=None, metavar="CMD",
                        help="command replacing examples/workloads/egl_render.py (as above)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs and per-run reports (default: a new folder under /tmp)")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds a run may overrun its window before it is killed (default: 20)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every report and the derived numbers to PATH")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and time estimate, run nothing")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0:
        parser.error("--seconds must be positive, --warmup not negative")
    return args


def verdict_line(verdict: str) -> str:
    if verdict == scoring.SEPARATE_GRAPHICS:
        return (f"{verdict}: compute and graphics overlap (both kept >= {scoring.OVERLAP_KEPT:g}); the daemon "
                "will not slice them against each other")
    if verdict == scoring.PARTIAL_OVERLAP:
        return (f"{verdict}: compute and graphics overlap partly (kept sum >= {scoring.MIX_SUM:g}); the daemon "
                "will mix slices: together part of the time, each alone as its weight share needs")
    return (f"{verdict}: compute and graphics contend (kept sum < {scoring.MIX_SUM:g}); the daemon "
            "will slice them against each other as one domain")


def summary(gpu: str, cfg: gp.Config, runs: dict[str, gp.GroupResult], entry: dict[str, Any],
            verdict: str, path: Path, gpus_in_file: list[str], warnings: list[str]) -> str:
    iters = entry["render_iterations"]
    lines = [f"contention calibration on GPU 0, {gpu} (render --iterations {iters if iters is not None else 'default'}; "
             f"{cfg.seconds:g} s windows after {cfg.warmup:g} s warm-up)",
             f"  {'':20}{'alone':>18}{'together':>18}{'kept':>8}"]
    for kind, label, key in (("cuda", "CUDA (compute)", "compute_kept"), ("render", "render (graphics)", "graphics_kept")):
        alone = next(t for t in runs["alone " + kind].tenants if t.kind == kind)
        together = next(t for t in runs["together"].tenants if t.kind == kind)
        unit = (alone.report or {}).get("unit", "")
        lines.append(f"  {label:20}{gp.fmt_tp(alone.throughput, unit):>18}{gp.fmt_tp(together.throughput, unit):>18}"
                     f"{entry[key]:>8.2f}")
    lines.append(f"  sum of kept: {entry['compute_kept'] + entry['graphics_kept']:.2f}")
    lines.append("verdict: " + verdict_line(verdict))
    low = min(entry["compute_kept"], entry["graphics_kept"])
    if abs(low - scoring.OVERLAP_KEPT) < NEAR_THRESHOLD:
        lines.append(f"  note: {low:.2f} is within {NEAR_THRESHOLD:g} of the {scoring.OVERLAP_KEPT:g} threshold: "
                     "measure again with a longer --seconds before trusting the verdict")
    lines.append(f"wrote {path} (GPUs in it: {', '.join(gpus_in_file)})")
    lines.append(f"a running daemon reads it only at start: restart `unisched serve --state-dir {path.parent}`")
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = gp.new_config(seconds=args.seconds, warmup=args.warmup, grace_s=args.grace, work_dir=args.work_dir,
                        dry_run=args.dry_run, workload_cmd_cuda=args.workload_cmd_cuda,
                        workload_cmd_render=args.workload_cmd_render, prefix="calibrate_contention-")
    calibrate = gp.render_calibration_wanted(cfg, args.render_fps, args.render_iterations)
    progress = gp.Progress(int(calibrate) + 3, name="calibrate_contention")
    est = (gp.CALIBRATION_S if calibrate else 0.0) + 3 * gp.run_seconds(cfg)
    progress.note(f"plan: {'render calibration, ' if calibrate else ''}cuda alone, render alone, cuda+render "
                  f"with no scheduler; estimated {est:.0f} s; writes {args.state_dir / gp.CONTENTION_FILE}; "
                  f"work dir {cfg.work_dir}")
    if args.dry_run:
        return 0
    gpu = args.gpu_name or gp.gpu0_name()
    try:
        if not gpu:
            raise gp.ContentionFileError("cannot name GPU 0 (nvidia-smi failed): pass --gpu-name")
        gp.check_contention_dir(args.state_dir)
    except gp.ContentionFileError as exc:
        print(f"calibrate_contention: error: {exc}", file=sys.stderr)
        return 2

    command = "python3 bench/calibrate_contention.py" + ("" if not sys.argv[1:] else " " + shlex.join(sys.argv[1:]))
    record: dict[str, Any] = {"command": command, "gpu": gpu, "gpus": gp.gpu_name(), "seconds": cfg.seconds,
                              "warmup": cfg.warmup, "workload_cmd": cfg.workload_cmd, "calibration": None,
                              "runs": {}, "entry": None, "verdict": None, "path": None,
                              "warnings": [], "errors": []}
    warnings: list[str] = record["warnings"]
    errors: list[str] = record["errors"]
    runs: dict[str, gp.GroupResult] = {}

    def finish(rc: int) -> int:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            record["runs"] = {k: g.to_json() for k, g in runs.items()}
            args.json.write_text(json.dumps(gp.finite(record), indent=2) + "\n")
        return rc

    if calibrate:
        cal, iters = gp.prepare_render(cfg, args.render_fps, progress)
        record["calibration"] = cal
        if iters is None:
            print(f"calibrate_contention: render calibration failed: {cal['error']}", file=sys.stderr)
            return finish(1)
    for key, label, specs in (
        ("alone cuda", "alone: cuda", [gp.TenantSpec("a-cuda", "cuda", None)]),
        ("alone render", "alone: render", [gp.TenantSpec("a-render", "render", None)]),
        ("together", "no scheduler: cuda+render",
         [gp.TenantSpec("a-cuda", "cuda", None), gp.TenantSpec("b-render", "render", None)]),
    ):
        progress.step(label)
        setup, name = label.split(": ")
        group = gp.run_group(cfg, name, setup, specs)
        runs[key] = group
        gp.check_group(group, warnings, errors)
        progress.note("  -> " + ", ".join(f"{t.name} {gp.fmt_tp(t.throughput, (t.report or {}).get('unit', ''))}"
                                          for t in group.tenants) + ("" if group.ok else " FAILED"))
        if not group.ok:
            break
    try:
        if errors or len(runs) < 3:
            raise gp.ContentionFileError("a run failed")
        compute_kept, graphics_kept = gp.kept_fractions(runs["alone cuda"], runs["alone render"], runs["together"])
        entry = gp.contention_entry(compute_kept, graphics_kept, command, gp.render_iterations_used(cfg))
        path = gp.write_contention_file(args.state_dir, gpu, entry)
    except (gp.ContentionFileError, OSError) as exc:
        errors.append(f"nothing written: {exc}")
        print("calibrate_contention: " + "\ncalibrate_contention: ".join(errors), file=sys.stderr)
        return finish(1)
    warnings += gp.device_warnings(gpu, list(runs.values()))
    verdict = scoring.contention_verdict(entry["compute_kept"], entry["graphics_kept"])
    record.update(entry=entry, verdict=verdict, path=str(path))
    gpus_in_file = sorted(gp.read_contention_file(args.state_dir)["gpus"])
    sys.stdout.write(summary(gpu, cfg, runs, entry, verdict, path, gpus_in_file, warnings))
    return finish(0)


if __name__ == "__main__":
    sys.exit(main())
