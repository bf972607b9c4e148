#!/usr/bin/env python3
"""Start-up cost of the GPU session hooks: CUDA and EGL context creation with and without the seccomp filter.

Runs, under a private `unisched serve`, `unisched run` of a tiny CUDA program (torch: init + one kernel) and a tiny
EGL program (context + one frame), each --repeat times with session hooks and with `--no-session-hooks`, timing the
GPU part inside the process (imports excluded). Target (issue 3): the hooks add < 20 ms. Writes results.json/md.

  python3 bench/hook_startup.py --out bench/results/DATE-GPU/hook-startup
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, bench_env, start_daemon

CUDA = ("import time, torch; t = time.perf_counter(); torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize(); "
        "print(time.perf_counter() - t)")
EGL = ("import os, sys, time; os.environ.setdefault('PYOPENGL_PLATFORM', 'egl'); "
       f"sys.path.insert(0, {str(ROOT / 'examples' / 'workloads')!r}); "
       "from egl_render import Renderer, gl_context; t = time.perf_counter(); "
       "ctx = gl_context(None); c = ctx.__enter__(); r = Renderer(64, 64); r.set_iterations(1); r.step(); "
       "print(time.perf_counter() - t); ctx.__exit__(None, None, None)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hook-startup-"))
    env = bench_env()
    daemon, sock = start_daemon(work)
    try:
        res: dict[str, dict[str, list[float]]] = {}
        for name, code in (("cuda", CUDA), ("egl", EGL)):
            for hooks in (True, False):
                key = "hooks" if hooks else "no hooks"
                times = []
                for i in range(args.repeat):
                    cmd = [sys.executable, "-m", "unisched", "run", "--socket", sock, "--tenant", f"hs-{name}",
                           *(() if hooks else ("--no-session-hooks",)), "--", sys.executable, "-c", code]
                    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
                    if p.returncode != 0:
                        print(f"{name} ({key}) failed: {p.stderr[-1500:]}", file=sys.stderr)
                        return 1
                    times.append(float(p.stdout.strip().splitlines()[-1]))
                    print(f"hook_startup: {name} {key} run {i + 1}/{args.repeat}: {times[-1] * 1000:.1f} ms",
                          file=sys.stderr)
                res.setdefault(name, {})[key] = times
    finally:
        daemon.terminate()
        daemon.wait(30)
    rows = []
    out = {"command": "python3 bench/hook_startup.py " + shlex.join(sys.argv[1:]),
           "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
           "repeat": args.repeat, "seconds": res, "added_ms_median": {}}
    for name, r in res.items():
        with_h, without = statistics.median(r["hooks"]), statistics.median(r["no hooks"])
        out["added_ms_median"][name] = (with_h - without) * 1000
        rows.append(f"| {name} | {without * 1000:.1f} ms | {with_h * 1000:.1f} ms | {(with_h - without) * 1000:+.1f} ms |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    md = (f"Command: `{out['command']}` | {out['date_utc']} UTC | host {out['host']}\n\n"
          "| app | GPU start-up without hooks (median) | with hooks | added (target < 20 ms) |\n|---|---|---|---|\n"
          + "\n".join(rows) + "\n")
    (args.out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
