#!/usr/bin/env python3
"""Registration load: N concurrent `unisched run --tenant ... -- true` against one daemon at default priority.

Each run is a real `python3 -m unisched run` (the CLI's own main(), session hooks on as by default), started all at
once. A run's registration latency is measured in that process, client side: from the start of connecting
(DaemonClient is constructed) to the reply of the daemon call(s) `run` makes before starting the command. The
report gives, per round: runs that failed (exit code != 0, with the first lines of their stderr), registration
latency p50/p99/max, time from process start to connecting (interpreter start and imports, under the burst) and
whole-run wall time p50/p99, plus the machine: CPUs, load before the round, Python, commit.

  python3 bench/registration_load.py --count 200 --rounds 3 --out bench/results/DATE-cpu-registration/after

The daemon runs `--no-nvml` as this user (root: real cgroups) at the nice value its config gives it (`serve` sets
it on itself; --daemon-nice passes `--nice`); the nice it really had is read from /proc and reported, with its CPU
time for the round. --profile DIR runs it under cProfile and writes DIR/daemon-roundN.prof and a top-20 text (its
CPU time then includes the profiler's cost). Runs use --tenants distinct tenant names round robin (each new one
is a cgroup and a state-file entry). Writes results.json and results.md to --out (when given) and prints a
summary with the verdict (every run of every round ok: met; else missed by how many runs); exits 1 when any run
failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, bench_env, start_daemon

RUN_TIMEOUT_S = 300.0
"""A run still going after this long is killed and counted as failed (a hang is a result, not a stuck bench)."""

# Runs inside each client process: times DaemonClient from construction to each call's reply, then runs the real
# CLI. CLOCK_MONOTONIC is system wide, so the parent's spawn time and the child's marks share one clock.
_WRAPPER = r"""
import json, os, sys, time
marks = {"start": time.monotonic(), "replies": []}
from unisched.transport import client as _c
def timed(f):
    def call(self, *a, **k):
        try:
            return f(self, *a, **k)
        finally:
            marks["replies"].append(time.monotonic())
    return call
_init = _c.DaemonClient.__init__
def init(self, *a, **k):
    marks.setdefault("connect", time.monotonic())
    _init(self, *a, **k)
_c.DaemonClient.__init__ = init
for name in ("_call", "_call_with"):
    if hasattr(_c.DaemonClient, name):
        setattr(_c.DaemonClient, name, timed(getattr(_c.DaemonClient, name)))
from unisched.cli.main import main
try:
    rc = main(sys.argv[1:])
finally:
    with open(os.environ["RL_MARKS"], "w") as f:
        json.dump(marks, f)
sys.exit(rc)
"""


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _commit(root: Path) -> str:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    if out.returncode != 0:
        return f"not a git checkout: {root}"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def machine(root: Path) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "kernel": platform.release(), "commit": _commit(root)}


def one_round(sock: str, count: int, tenants: int, prefix: str, work: Path, root: Path) -> dict[str, Any]:
    """Start `count` runs at once, wait for all; per-run marks and exit codes."""
    env = {**bench_env(), "PYTHONPATH": str(root)}
    procs = []
    load = os.getloadavg()
    for i in range(count):
        marks = work / f"marks-{i}.json"
        marks.unlink(missing_ok=True)
        errf = (work / f"stderr-{i}.txt").open("wb")
        spawned = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _WRAPPER, "run", "--socket", sock, "--tenant",
                              f"{prefix}{i % tenants}", "--", "true"], stdout=subprocess.DEVNULL, stderr=errf,
                             env={**env, "RL_MARKS": str(marks)}, cwd=root)
        errf.close()
        procs.append((p, spawned, marks, work / f"stderr-{i}.txt"))
    runs = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p, spawned, marks, err in procs:
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        ended = time.monotonic()
        m = json.loads(marks.read_text()) if marks.exists() else {}
        run: dict[str, Any] = {"rc": rc, "wall_s": ended - spawned}
        if "connect" in m:
            run["to_connect_s"] = m["connect"] - spawned
            if m["replies"]:
                run["register_s"] = m["replies"][-1] - m["connect"]
        if rc != 0:
            run["stderr"] = err.read_text(errors="replace")[-300:]
        runs.append(run)
    return {"load_before": load, "runs": runs}


def daemon_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds the daemon used, user + system, all threads; its main thread's nice value) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[16])


def _profile_top(prof: Path, n: int = 20) -> str:
    """The top `n` functions by own time, then by cumulative time (pstats text)."""
    import io
    import pstats

    out = io.StringIO()
    st = pstats.Stats(str(prof), stream=out)
    st.sort_stats("tottime").print_stats(n)
    st.sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def _remove_cgroups(prefix: str) -> None:
    """The round's tenant cgroups (the daemon keeps them across restarts); their `true` has exited."""
    sys.path.insert(0, str(ROOT))
    from unisched.enforce.cgroups import detect_driver

    driver = detect_driver("auto")
    for cg in driver.managed():
        if cg.rsplit("/", 1)[-1].startswith(prefix) and not driver.pids(cg):
            driver.remove(cg)


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    runs = r["runs"]
    reg = [x["register_s"] for x in runs if "register_s" in x and x["rc"] == 0]
    conn = [x["to_connect_s"] for x in runs if "to_connect_s" in x]
    wall = [x["wall_s"] for x in runs]
    failed = [x for x in runs if x["rc"] != 0]
    errors: dict[str, int] = {}
    for x in failed:
        line = (x.get("stderr") or f"exit {x['rc']}").strip().splitlines()[-1:] or [f"exit {x['rc']}"]
        errors[line[0]] = errors.get(line[0], 0) + 1
    ms = 1000.0
    return {
        "runs": len(runs), "failed": len(failed), "errors": errors, "load_before": r["load_before"],
        "register_ms": {"p50": ms * percentile(reg, 0.5), "p99": ms * percentile(reg, 0.99),
                        "max": ms * max(reg, default=float("nan"))},
        "to_connect_ms": {"p50": ms * percentile(conn, 0.5), "p99": ms * percentile(conn, 0.99)},
        "wall_ms": {"p50": ms * percentile(wall, 0.5), "p99": ms * percentile(wall, 0.99)},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=200, help="concurrent runs per round (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each against a fresh daemon (default 3)")
    ap.add_argument("--tenants", type=int, default=200,
                    help="distinct tenant names the runs use, round robin (default 200: one new tenant per run)")
    ap.add_argument("--daemon-nice", type=int,
                    help="pass `--nice N` to the daemon (default: none, the daemon's configured default)")
    ap.add_argument("--profile", type=Path, help="run the daemon under cProfile; .prof and top-20 text here")
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    ap.add_argument("--checkout", type=Path, default=ROOT,
                    help="the unisched checkout whose daemon and CLI run (default this one; e.g. a `git worktree` of "
                         "an older commit for a before/after comparison)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("registration_load: needs root (the daemon creates tenant cgroups)", file=sys.stderr)
        return 2
    root = args.checkout.resolve()
    info = {**machine(root), "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "count": args.count,
            "tenants": args.tenants,
            "daemon_nice": "none (config default)" if args.daemon_nice is None else args.daemon_nice}
    rounds = []
    for n in range(args.rounds):
        work = Path(tempfile.mkdtemp(prefix="unisched-rl-", dir="/tmp"))
        prefix = f"rl{os.getpid()}r{n}-"
        extra = ["--no-nvml", "--log-level", "warning"]
        if args.daemon_nice is not None:
            extra += ["--nice", str(args.daemon_nice)]
        prof = None
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            prof = args.profile.resolve() / f"daemon-round{n + 1}.prof"
        daemon, sock = start_daemon(work, *extra, root=root, profile=prof)
        try:
            cpu0, nice = daemon_cpu(daemon.pid)
            s = summarize(one_round(sock, args.count, max(1, args.tenants), prefix, work, root))
            cpu1, _ = daemon_cpu(daemon.pid)
            s["daemon"] = {"nice": nice, "cpu_s": cpu1 - cpu0, "cpu_ms_per_run": 1000 * (cpu1 - cpu0) / args.count,
                           "profiled": prof is not None}
        finally:
            daemon.terminate()
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
            shutil.rmtree(work, ignore_errors=True)
            _remove_cgroups(prefix)
        if prof is not None and prof.exists():
            (args.profile / f"daemon-round{n + 1}-top.txt").write_text(_profile_top(prof))
        rounds.append(s)
        print(f"round {n + 1}: {s['runs'] - s['failed']}/{s['runs']} ok; registration p50 "
              f"{s['register_ms']['p50']:.0f} ms p99 {s['register_ms']['p99']:.0f} ms max {s['register_ms']['max']:.0f} ms; "
              f"start->connect p50 {s['to_connect_ms']['p50']:.0f} ms p99 {s['to_connect_ms']['p99']:.0f} ms; "
              f"load before {s['load_before'][0]:.2f}; daemon nice {s['daemon']['nice']}, CPU "
              f"{s['daemon']['cpu_ms_per_run']:.1f} ms/run; errors {s['errors'] or '-'}", flush=True)
    res = {"machine": info, "rounds": rounds, "verdict": verdict(rounds)}
    print(f"verdict: {res['verdict']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
        (args.out / "results.md").write_text(_markdown(res))
    return 1 if any(r["failed"] for r in rounds) else 0


def verdict(rounds: list[dict[str, Any]]) -> str:
    """The goal: every run of every round exits 0."""
    failed = sum(r["failed"] for r in rounds)
    runs = sum(r["runs"] for r in rounds)
    if not failed:
        return f"met: {runs}/{runs} runs ok over {len(rounds)} rounds"
    per = ", ".join(str(r["failed"]) for r in rounds)
    return f"missed by {failed} of {runs} runs (failed per round: {per})"


def _markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    md = (f"# registration load: {m['count']} concurrent `unisched run` ({m['tenants']} tenant names)\n\n"
          f"{m['date_utc']}; {m['cpus']} CPUs ({m['cpu_model']}), Python {m['python']}, kernel {m['kernel']}, "
          f"commit {m['commit']}, daemon nice flag {m['daemon_nice']}\n\n`{m['command']}`\n\n"
          f"Verdict (all {m['count']} ok in every round): **{res['verdict']}**\n\n"
          "| round | ok | failed | registration p50 | p99 | max | start->connect p50 | p99 | run wall p50 | p99 | "
          "load before | daemon nice | daemon CPU/run |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for i, r in enumerate(res["rounds"], 1):
        md += (f"| {i} | {r['runs'] - r['failed']} | {r['failed']} | {r['register_ms']['p50']:.0f} ms | "
               f"{r['register_ms']['p99']:.0f} ms | {r['register_ms']['max']:.0f} ms | {r['to_connect_ms']['p50']:.0f} ms | "
               f"{r['to_connect_ms']['p99']:.0f} ms | {r['wall_ms']['p50']:.0f} ms | {r['wall_ms']['p99']:.0f} ms | "
               f"{r['load_before'][0]:.2f} | {r['daemon']['nice']} | {r['daemon']['cpu_ms_per_run']:.1f} ms"
               f"{' (profiled)' if r['daemon']['profiled'] else ''} |\n")
    errs = {k: v for r in res["rounds"] for k, v in r["errors"].items()}
    if errs:
        md += "\nErrors (last stderr line, count in the last round that had it):\n\n"
        md += "".join(f"- `{k}`: {v}\n" for k, v in errs.items())
    return md


if __name__ == "__main__":
    raise SystemExit(main())
