#!/usr/bin/env python3
"""05: two examples side by side under one daemon, each a cooperative tenant with its own weight.

Starts both with the same measurement window, waits, and prints each one's throughput and measured share
(and, with --alone, first runs each alone without unisched to print normalized throughput = shared/alone).
A daemon must be serving on --socket (`unisched serve`, or `sudo systemctl start unisched`).

  python3 examples/05_side_by_side.py --a 02 --a-weight 300 --b 03 --b-weight 100 --seconds 20 --alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXAMPLES = {"01": "01_pycuda_kernel_loop.py", "02": "02_pytorch_training.py", "03": "03_egl_render.py",
            "04": "04_nvdec_decode.py"}


def run(specs: list[tuple[str, str, int | None]], args: argparse.Namespace, out: Path, warmup: float) -> list[dict[str, Any]]:
    start_at = time.time() + warmup
    procs = []
    for name, ex, weight in specs:
        cmd = [sys.executable, str(HERE / EXAMPLES[ex]), "--seconds", str(args.seconds), "--start-at", f"{start_at:.3f}",
               "--report", str(out / f"{name}.json"), *args.extra]
        if weight is not None:
            cmd += ["--tenant", name, "--weight", str(weight), "--socket", args.socket]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    for p in procs:
        p.wait(timeout=warmup + args.seconds + 120)
    reports = []
    for (name, _, _), p in zip(specs, procs, strict=True):
        path = out / f"{name}.json"
        if p.returncode != 0 or not path.exists():
            raise SystemExit(f"05_side_by_side: {name} failed (exit {p.returncode})")
        reports.append(json.loads(path.read_text()))
    return reports


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", choices=sorted(EXAMPLES), default="02")
    ap.add_argument("--b", choices=sorted(EXAMPLES), default="03")
    ap.add_argument("--a-weight", type=int, default=300)
    ap.add_argument("--b-weight", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=20.0,
                    help="start-up time before the shared window; PyTorch's first steps take seconds (default 20)")
    ap.add_argument("--socket", default=os.environ.get("UNISCHED_SOCKET", "/run/unisched/unisched.sock"))
    ap.add_argument("--alone", action="store_true", help="first run each alone without unisched")
    ap.add_argument("--out", type=Path, default=None, help="where the JSON reports go (default: a temp folder)")
    ap.add_argument("extra", nargs="*", help="arguments passed to both examples (after --)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="unisched-05-"))
    out.mkdir(parents=True, exist_ok=True)
    a, b = f"ex{args.a}-a", f"ex{args.b}-b"
    alone: dict[str, float] = {}
    if args.alone:
        for name, ex in ((a, args.a), (b, args.b)):
            print(f"== {name} alone, without unisched", flush=True)
            alone[name] = run([(name + "-alone", ex, None)], args, out, args.warmup)[0]["throughput"]
    print(f"== {a} (weight {args.a_weight}) and {b} (weight {args.b_weight}) under unisched", flush=True)
    reports = run([(a, args.a, args.a_weight), (b, args.b, args.b_weight)], args, out, args.warmup)
    total = args.a_weight + args.b_weight
    # the target is the weights' split while both run: the daemon's own figure is read after the window, when
    # the tenant that finished first may be gone (the other then reads 100%)
    print("\ntenant          weight  throughput        share measured/target  normalized (shared/alone)")
    for (name, w), r in zip(((a, args.a_weight), (b, args.b_weight)), reports, strict=True):
        s = r.get("share", {})
        norm = f"{r['throughput'] / alone[name]:.2f} (weight share {w / total:.2f})" if name in alone else "-"
        print(f"{name:<15} {w:>6}  {r['throughput']:>8.1f} {r['unit']:<8} "
              f"{100 * s.get('measured_share', 0):5.1f}% / {100 * w / total:5.1f}%     {norm}")
    print(f"\nreports in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
