"""bench/gpu_pairs.py's command line: the pairs, windows, daemon settings and outputs it takes, and the checks
that reject a combination it cannot run (exit status 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pairs_plan import kind_pairs, parse_pairs

from unisched.scheduler.config import DaemonConfig

DEFAULT_PAIRS = "cuda3:1,render1:1,render3:1,mixed1:1,mixed1:3"
DEFAULT_UNISCHED_WARMUP_S = 15.0  # a low-weight tenant is frozen for most of its own start-up
TIME_BUDGET_S = 540.0  # the whole invocation must fit a 10-minute device call with room to spare


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark GPU sharing on pairs of saturating tenants: each workload alone, each "
                    "pair together with no scheduler, and each weighted pair under `unisched serve` "
                    "(tenants started with `unisched run --weight W --engines compute|graphics`). "
                    "Scores normalized throughput, error, sum and the guarantee (bench/README.md) and "
                    "writes results.json and results.md to --out.",
        epilog=f"""pairs (--pairs, comma separated, KINDSa:b):
  cuda3:1      CUDA matmuls + CUDA matmuls, weights 3:1         (contend)
  render1:1    EGL render + EGL render, 1:1 (also render3:1)     (contend)
  mixed1:3     CUDA (weight 1) + EGL render (weight 3)           (overlap on the H200)
  nvdec1:1     NVDEC decode + NVDEC decode (examples/04_nvdec_decode.py)  (contend)
  default: {DEFAULT_PAIRS}

time: every run takes about warmup + seconds (+ ~3 s), runs under unisched --unisched-warmup + seconds
(+ ~6 s with the daemon); runs = workload kinds alone + kind pairs with no scheduler + weighted pairs
under unisched. Defaults: 2 + 3 runs of ~28 s and 5 of ~41 s plus render calibration: estimated 355 s
(about 6 minutes). The plan and estimate are
printed first (--dry-run prints only that).

calibration (--calibrate-out DIR): the no-scheduler cuda+render run (needs a mixed pair) also writes
DIR/contention.json for GPU 0, exactly as `unisched calibrate` does, and every unisched daemon
then starts with a copy of that file in its state dir. No extra runs.

on the GPU machine (carry .devcache):
  source .devcache/setup.sh && python3 bench/gpu_pairs.py --out $OUT/pairs --calibrate-out $OUT/state

without a GPU (checks the pipeline with CPU stand-ins, no daemon):
  python3 bench/gpu_pairs.py --no-unisched --seconds 3 --warmup 1 --out /tmp/pairs \\
    --workload-cmd-cuda "python3 bench/cpu_standin.py --kind cuda --pin-cpu 0" \\
    --workload-cmd-render "python3 bench/cpu_standin.py --kind render --pin-cpu 1"

exit status: 0 when every run produced its reports (verdicts may still be FAIL: read the
table), 1 when a run failed or was skipped, 2 for bad arguments.""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json and results.md")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per run (default: 20)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds from launch to the window's start; covers process start-up "
                             "(torch import, CUDA/EGL init) and warm-up (default: 5)")
    parser.add_argument("--unisched-warmup", type=float, default=DEFAULT_UNISCHED_WARMUP_S, metavar="S",
                        help="--warmup for the runs under unisched only: there a low-weight tenant is frozen "
                             "for most of its own start-up, which then takes several times longer "
                             f"(default: {DEFAULT_UNISCHED_WARMUP_S:g})")
    parser.add_argument("--slice-ms", type=float, default=DaemonConfig().slice_ms,
                        help="unisched serve --slice-ms (default: the daemon's, %(default)g)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for every `unisched serve` (repeatable), e.g. --serve-arg=--log-level "
                             "--serve-arg=debug to log why a sliced pair stays sliced")
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help=f"pairs to run (default: {DEFAULT_PAIRS})")
    parser.add_argument("--no-unisched", action="store_true",
                        help="skip the unisched phase (alone and no-scheduler runs only)")
    parser.add_argument("--render-fps", type=float, default=36.0,
                        help="calibrate the render load alone to about this many frames/s before the "
                             "runs (36.9 on the H200); 0 = no calibration (default: 36)")
    parser.add_argument("--render-iterations", type=int, default=None,
                        help="fixed egl_render.py --iterations; skips calibration")
    parser.add_argument("--workload-cmd-cuda", default=None, metavar="CMD",
                        help="command replacing examples/workloads/cuda_matmul.py (shell words; the "
                             "window arguments are appended), e.g. a CPU stand-in for testing")
    parser.add_argument("--workload-cmd-render", default=None, metavar="CMD",
                        help="command replacing examples/workloads/egl_render.py (as above)")
    parser.add_argument("--workload-cmd-nvdec", default=None, metavar="CMD",
                        help="command replacing examples/04_nvdec_decode.py (as above)")
    parser.add_argument("--unisched-module", default="unisched",
                        help="module run as `python -m MODULE serve|status|run|tenants` (default: "
                             "unisched; another module lets the orchestration be tested against a fake)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs, reports and daemon state (default: a new folder under /tmp)")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds a run may overrun its window before its tenants are killed (default: 20)")
    parser.add_argument("--max-total", type=float, default=TIME_BUDGET_S, metavar="S",
                        help="skip any step that would end later than S seconds after the start, so the "
                             f"whole invocation fits one device call (default: {TIME_BUDGET_S:g})")
    parser.add_argument("--calibrate-out", type=Path, default=None, metavar="DIR",
                        help="also write the daemon's contention calibration for GPU 0, from the alone and "
                             "no-scheduler cuda+render runs, to DIR/contention.json (merged: other GPUs' "
                             "entries kept), and start the unisched daemons with a copy of it")
    parser.add_argument("--gpu-name", default=None, metavar="NAME",
                        help="with --calibrate-out: the GPU name to file it under (default: GPU 0's name "
                             "from nvidia-smi, which is what the daemon looks up)")
    parser.add_argument("--engine", choices=["kernel", "user"], default="kernel",
                        help="kernel: tenants run under `unisched run` (freezer); user: the workloads are cooperative "
                             "clients (they get --tenant/--weight/--socket; use the numbered examples, e.g. "
                             "--workload-cmd-cuda 'python3 examples/02_pytorch_training.py') (default: kernel)")
    parser.add_argument("--overhead", action="store_true",
                        help="also run each kind alone under unisched (weight 100) and report the throughput lost")
    parser.add_argument("--overhead-only", action="store_true",
                        help="with --overhead: only the alone runs and the alone runs under unisched (no pairs)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run everything N times, each round against its own solo runs (and its own "
                             "calibration with --calibrate-out), into OUT/round-K/; OUT/results.md gives each "
                             "pair's medians with ranges and how many rounds passed (default 1)")
    parser.add_argument("--solo-after", action="store_true",
                        help="run the solo runs again after the shared ones and normalize against the mean of "
                             "the two (a warning names a solo that moved > 10%%): for workloads whose rate drifts "
                             "between minutes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and time estimate, run nothing")
    args = parser.parse_args(argv)
    try:
        args.pair_list = parse_pairs(args.pairs)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.overhead_only and (not args.overhead or args.no_unisched):
        parser.error("--overhead-only needs --overhead (and the daemon: not --no-unisched)")
    if args.seconds <= 0 or args.warmup < 0 or args.unisched_warmup < 0 or args.slice_ms <= 0:
        parser.error("--seconds and --slice-ms must be positive, --warmup and --unisched-warmup not negative")
    if args.calibrate_out is not None and ("cuda", "render") not in kind_pairs(args.pair_list):
        parser.error("--calibrate-out measures on the no-scheduler cuda+render run: select a mixed pair "
                     "(e.g. --pairs ...,mixed1:1)")
    return args
