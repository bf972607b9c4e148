#!/usr/bin/env python3
"""Start-up cost of the GPU session hooks: a CUDA and an EGL context's creation with and without the seccomp filter.

Under a private `unisched serve`, `unisched run` starts a small program that makes a context and uses it once, timing
that inside the process (the interpreter's own start excluded):

  cuda  libcuda through ctypes: cuInit, the device's primary context, a 1 MiB allocation and memset, synchronize
        (the same driver calls a framework makes for its first context, without seconds of framework import)
  egl   an EGL display and context on a pbuffer, made current, one clear, glFinish
  replay  no GPU: a CUDA context's notified RM calls (bench/hook_answer.py's list) made on /dev/null, each after
        --gap-us of busy time, as the driver spaces them; the same hooks and daemon without the driver, so that
        what a real context adds beyond it is the driver's or the machine's
  replay-mapping  the replay while another thread of the same process maps and unmaps 4 MiB in a loop, as a
        driver's threads map memory while its context starts (read the daemon's times: the start-up times also
        carry the two threads' contention for the interpreter)
  replay-spinning  the control: the same second thread, busy without mapping anything

Runs come in pairs, one with the hooks and one with `--no-session-hooks`, their order alternating, so that a drift of
the machine over the round falls on both alike. The first --warmup pairs of each program are not counted (the
first start of a program loads the driver's files from disk). A whole start-up varies by tens of milliseconds from
run to run, far more than the hooks add, so the result is the mean of the --repeat paired differences with its 90%
Student-t interval; a bound on the hooks is only as tight as that interval. Each start also times its two phases,
init (the driver loaded, the device opened) and context (the context made and used once), and the report gives
their paired differences too: which phase carries the noise and which the hooks' cost. The daemon's metrics
(unisched_tenant_hook_*) give the notified calls a hooked start made and the daemon's mean time to answer one, so
that the cost can be read per call. Writes results.json and
results.md.

  python3 bench/hook_startup.py --out bench/results/DATE-GPU/hook-startup
  python3 bench/hook_startup.py --programs replay --sample daemon-stacks.json --out /tmp/hs   # no GPU needed
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, bench_env, free_port, scrape, start_daemon, stop_daemon
from _results import header, run_info, write
from verdicts import mean_interval

CUDA = """
import ctypes, json, time
t = time.perf_counter()
cu = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r:
        raise SystemExit(f"{what} failed: CUresult {r}")
ok(cu.cuInit(0), "cuInit")
t_init = time.perf_counter()
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
size = ctypes.c_size_t(1 << 20)
ok(cu.cuMemAlloc_v2(ctypes.byref(ptr), size), "cuMemAlloc")
ok(cu.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), size), "cuMemsetD8")
ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
t_end = time.perf_counter()
print(json.dumps({"total": t_end - t, "init": t_init - t, "context": t_end - t_init}))
"""
EGL = f"""
import json, os, sys, time
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
sys.path.insert(0, {str(ROOT / 'examples' / 'workloads')!r})
from OpenGL import GL
from _egl import Egl, create_context, open_display
t = time.perf_counter()
egl = Egl()
display = open_display(egl, None)
t_init = time.perf_counter()
ctx = create_context(egl, display)
GL.glClearColor(0.2, 0.4, 0.6, 1.0)
GL.glClear(GL.GL_COLOR_BUFFER_BIT)
GL.glFinish()
t_end = time.perf_counter()
ctx.close()
print(json.dumps({{"total": t_end - t, "init": t_init - t, "context": t_end - t_init}}))
"""
REPLAY = f"""
import ctypes, json, os, sys, time
sys.path.insert(0, {str(ROOT / 'bench')!r})
from hook_answer import context, rm_call
libc = ctypes.CDLL(None, use_errno=True)
gap_ns = int(float(os.environ["HOOK_STARTUP_GAP_US"]) * 1000)
t = time.perf_counter()
dev = os.open("/dev/null", os.O_RDWR)
t_init = time.perf_counter()
for _, nr, words, size in context("cuda", 0xC1D00000):
    rm_call(libc, dev, nr, words, size, gap_ns)
t_end = time.perf_counter()
print(json.dumps({{"total": t_end - t, "init": t_init - t, "context": t_end - t_init}}))
"""
MAPPING = REPLAY.replace("t = time.perf_counter()\n", """import mmap, threading
mapping = True
def remap():  # what a driver's own threads do while its context starts: map and unmap memory
    while mapping:
        m = mmap.mmap(-1, 1 << 22)
        m[0] = m[1 << 21] = 1
        m.close()
threading.Thread(target=remap, daemon=True).start()
t = time.perf_counter()
""", 1).replace("t_end = time.perf_counter()\n", "t_end = time.perf_counter()\nmapping = False\n", 1)
SPINNING = MAPPING.replace("""        m = mmap.mmap(-1, 1 << 22)
        m[0] = m[1 << 21] = 1
        m.close()""", """        sum(range(1000))  # the same thread and load, no mapping: the control""", 1)
PROGRAMS = {"cuda": CUDA, "egl": EGL, "replay": REPLAY, "replay-mapping": MAPPING, "replay-spinning": SPINNING}


def one_run(sock: str, name: str, hooks: bool, env: dict[str, str]) -> dict[str, float]:
    """One start under `unisched run`: the seconds the program timed, in all ("total") and by phase ("init": the
    driver loaded and the device opened; "context": the context made and used once). Exits with its error when it
    fails."""
    cmd = [sys.executable, "-m", "unisched", "run", "--socket", sock, "--tenant", f"hs-{name}",
           *(() if hooks else ("--no-session-hooks",)), "--", sys.executable, "-c", PROGRAMS[name]]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    if p.returncode != 0:
        raise SystemExit(f"hook_startup: {name} ({'hooks' if hooks else 'no hooks'}) failed: {p.stderr[-1500:]}")
    return {k: float(v) for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def hooked_calls(port: int, tenant: str, runs: int) -> dict[str, float]:
    """What the daemon's metrics say of `tenant`'s `runs` hooked starts: the notified calls a start made, the mean
    time the daemon took from a notification to its answer (of the calls its event loop decided, and of the
    others), and the mean time in the answers' own system calls. The metrics are copied once a second, so this
    reads until two scrapes over a second apart agree (30 s at most)."""
    names = ("unisched_tenant_hook_calls_total", "unisched_tenant_hook_answer_seconds_total",
             "unisched_tenant_hook_decisions_total", "unisched_tenant_hook_decision_seconds_total",
             "unisched_tenant_hook_send_seconds_total")

    def read() -> tuple[float, ...]:
        got = {n: v for n, labels, v in scrape(port) if labels.get("tenant") == tenant}
        return tuple(got.get(n, 0.0) for n in names)

    last, deadline = read(), time.monotonic() + 30
    while True:
        time.sleep(1.2)
        now = read()
        if now == last or time.monotonic() > deadline:
            break
        last = now
    calls, answer_s, decided, decided_s, send_s = now
    return {"runs": runs, "calls_per_start": calls / runs if runs else 0.0,
            "answer_us_mean": answer_s / calls * 1e6 if calls else 0.0,
            "decisions_per_start": decided / runs if runs else 0.0,
            "decision_us_mean": decided_s / decided * 1e6 if decided else 0.0,
            "undecided_us_mean": (answer_s - decided_s) / (calls - decided) * 1e6 if calls > decided else 0.0,
            "send_us_mean": send_s / calls * 1e6 if calls else 0.0}


def summarize(diffs_ms: list[float]) -> dict[str, Any]:
    """What the hooks added, from the paired differences (with minus without, ms)."""
    iv = mean_interval(diffs_ms)
    return {"n": len(diffs_ms), "mean": statistics.fmean(diffs_ms), "median": statistics.median(diffs_ms),
            "stdev": statistics.stdev(diffs_ms) if len(diffs_ms) > 1 else None,
            "lo90": None if iv is None else iv[0], "hi90": None if iv is None else iv[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=24, help="counted pairs per program (default 24)")
    ap.add_argument("--warmup", type=int, default=1, help="pairs per program run first and not counted (default 1)")
    ap.add_argument("--programs", default="cuda,egl", help=f"which of {', '.join(PROGRAMS)} (default cuda,egl)")
    ap.add_argument("--gap-us", type=float, default=800.0,
                    help="replay: busy time before each call (default 800 us, a CUDA context's context phase on the "
                         "H200 over its notified calls)")
    ap.add_argument("--sample", type=Path,
                    help="run the daemon under bench/stack_sampler.py, its findings written to this file (what held "
                         "its event loop while the contexts started)")
    args = ap.parse_args()
    names = [n for n in args.programs.split(",") if n]
    if args.repeat < 2 or args.warmup < 0 or not names or any(n not in PROGRAMS for n in names):
        ap.error("--repeat must be 2 or more, --warmup not negative, --programs of " + ", ".join(PROGRAMS))
    if args.gap_us < 0:
        ap.error("--gap-us must not be negative")
    work = Path(tempfile.mkdtemp(prefix="hook-startup-"))
    env = {**bench_env(), "HOOK_STARTUP_GAP_US": str(args.gap_us)}
    port = free_port()
    daemon, sock = start_daemon(work, "--metrics-port", str(port), sample=args.sample.resolve() if args.sample else None)
    seconds: dict[str, dict[str, list[dict[str, float]]]] = {}
    calls: dict[str, dict[str, float]] = {}
    diffs: dict[str, dict[str, list[float]]] = {}  # program -> phase ("total", "init", "context") -> ms per pair
    try:
        for name in names:
            seconds[name] = {"hooks": [], "no hooks": []}
            diffs[name] = {}
            for i in range(args.warmup + args.repeat):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {hooks: one_run(sock, name, hooks, env) for hooks in order}
                if i < args.warmup:
                    continue
                seconds[name]["hooks"].append(got[True])
                seconds[name]["no hooks"].append(got[False])
                for phase in got[True]:
                    diffs[name].setdefault(phase, []).append((got[True][phase] - got[False][phase]) * 1000)
                print(f"hook_startup: {name} pair {i + 1 - args.warmup}/{args.repeat}: with "
                      f"{got[True]['total'] * 1000:.1f} ms, without {got[False]['total'] * 1000:.1f} ms", file=sys.stderr)
            calls[name] = hooked_calls(port, f"hs-{name}", args.warmup + args.repeat)
    finally:
        stop_daemon(daemon, work)
    added = {name: summarize(d["total"]) for name, d in diffs.items()}
    out = {**run_info(), "repeat": args.repeat, "warmup": args.warmup, "seconds": seconds,
           "added_ms_pairs": {name: d["total"] for name, d in diffs.items()}, "added_ms": added, "hooked_calls": calls,
           "added_ms_by_phase": {name: {ph: summarize(v) for ph, v in d.items() if ph != "total"}
                                 for name, d in diffs.items()}}

    def row(label: str, name: str, phase: str, a: dict[str, Any]) -> str:
        med = {k: statistics.median(r[phase] for r in seconds[name][k]) * 1000 for k in ("no hooks", "hooks")}
        return (f"| {label} | {med['no hooks']:.1f} ms | {med['hooks']:.1f} ms | {a['mean']:+.1f} ms | "
                f"{a['median']:+.1f} ms | {a['lo90']:+.1f} to {a['hi90']:+.1f} ms |")

    rows = [row(name, name, "total", a) for name, a in added.items()]
    rows += [row(f"{name}: {ph}", name, ph, a) for name, d in out["added_ms_by_phase"].items() for ph, a in d.items()]
    md = (header(out) + f"{args.repeat} pairs per program, order alternating, after {args.warmup} not counted. The phases: init "
          "(the driver loaded, the device opened), context (the context made and used once).\n\n"
          "| program | start-up without hooks (median) | with hooks (median) | added, mean of pairs | median of pairs "
          "| 90% interval of the mean |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
          "The daemon's count of the hooked starts' calls (its metrics, over every hooked start of the program):\n\n"
          "| program | notified calls a start | mean time to the answer in the daemon | of which decided on the event "
          "loop, a start | their mean time | the other calls' mean time | mean time in the answer's own system call "
          "|\n|---|---|---|---|---|---|---|\n"
          + "".join(f"| {name} | {c['calls_per_start']:.1f} | {c['answer_us_mean']:.1f} us "
                    f"| {c['decisions_per_start']:.1f} | {c['decision_us_mean']:.1f} us "
                    f"| {c['undecided_us_mean']:.1f} us | {c['send_us_mean']:.1f} us |\n"
                    for name, c in calls.items())
          + "\nThe answer's own system call is timed apart: the kernel wakes the caller in it, and with sync wake-up "
          "the caller may run on the daemon's CPU before it returns (its wait had ended by then).\n")
    write(args.out, out, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
