#!/usr/bin/env python3
"""Mixed training + FurMark-style render: ResNet-50 training (batch 32, synthetic data) next to a
heavy 1920x1080 EGL fragment-shader render, each a cooperative tenant with its own weight, under one daemon.

It is 05_side_by_side.py with 02 (training) and 03 (render) and the weights given as A:B, so the scenario can be
run by hand (bench/run.py's overlap suite measures the same pair under unisched run). A daemon must be serving
on --socket. Without the daemon, run the two examples by hand to see the driver's own time-slicing.

  unisched serve &
  python3 examples/mixed_train_render.py --weights 3:1 --seconds 20 --alone
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def side_by_side_argv(args: argparse.Namespace) -> list[str]:
    a, b = (int(w) for w in args.weights.split(":"))
    argv = ["05_side_by_side.py", "--a", "02", "--b", "03", "--a-weight", str(a), "--b-weight", str(b),
            "--seconds", f"{args.seconds:g}", "--warmup", f"{args.warmup:g}", "--socket", args.socket]
    return argv + (["--alone"] if args.alone else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="1:1", help="training:render weights, e.g. 1:1, 3:1, 1:3 (default 1:1)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window (default 20)")
    ap.add_argument("--warmup", type=float, default=20.0, help="start-up before the window (default 20)")
    ap.add_argument("--alone", action="store_true", help="first run each alone to print normalized throughput")
    ap.add_argument("--socket", default=os.environ.get("UNISCHED_SOCKET", "/run/unisched/unisched.sock"))
    args = ap.parse_args(argv)
    parts = args.weights.split(":")
    if len(parts) != 2 or not all(p.isdigit() and 1 <= int(p) <= 10000 for p in parts):
        ap.error(f"--weights {args.weights!r}: two weights 1..10000 as A:B, e.g. 3:1")
    sys.argv = side_by_side_argv(args)
    runpy.run_path(str(HERE / "05_side_by_side.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
