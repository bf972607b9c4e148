#!/usr/bin/env python3
"""Mixed-engine pairs on the GPU: a cooperative client (leases) beside an unmodified app (`unisched run`, the
freezer), and two clients, each pair at several weights, in rounds; for CUDA and for render.

Why: one weight must hold whichever way a tenant is governed. CUDA: the client is examples/workloads/cuda_matmul.py
--client, each step of K bf16 4096x4096 matmuls inside `client.step()` (K=8 is about 1.7 ms on the H200, K=240
about 50 ms); the app is the same workload unmodified, bf16 8192x8192 matmuls synchronised every 4. Render: the
client is examples/workloads/egl_render.py --client, every frame inside `FrameGate`; the app is the same render
unmodified (--render-iterations sets a frame's cost). bench/mixed_pairs.py defines the members and their commands.

Each round runs every member alone under the daemon first (its alone rate), then every pair at every weight with
a fresh daemon. A pair's score: each side's rate (matmul/s or frames/s) over its alone rate (normalized), error =
the largest distance of a side's part of the sum from its weight share, in points, and the sum. The verdict per
(pair, weights) is computed here from every round against the bar below; nothing is dropped or rerun.

  python3 bench/mixed_engines.py --out bench/results/DATE-mixed-engines --rounds 3
  python3 bench/mixed_engines.py --out DIR --pairs frame+render,frame+frame --dry-run    the plan and its length
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, bench_env, start_daemon, stop_daemon
from _results import save_json, write_atomic
from mixed_pairs import (
    DEFAULT_PAIRS,
    DEFAULT_SECONDS,
    DEFAULT_WARMUP_S,
    DEFAULT_WEIGHTS,
    RENDER_ITERATIONS,
    Member,
    Workloads,
    members_of,
    parse_pairs,
    parse_weights,
    plan,
    round_seconds,
    window_s,
)
from provenance import commit as tree_commit
from provenance import machine
from scoring import (
    MAX_ERROR_POINTS,
    MAX_MEDIAN_ERROR_POINTS,
    MIN_CONTENDING_EFFICIENCY,
    common_window,
    efficiency,
    error_points,
    guarantee_ok,
    rates_over,
    short_window,
)

# The bar of the kernel-only pairs (scoring.py), held for mixed pairs too: the median and worst round's error, the
# sum in every round, and every side's guarantee (its weight share, less GUARANTEE_SLACK) in every round.


def run_together(members: list[tuple[Member, int]], args: argparse.Namespace, work: Path, label: str,
                 seconds: float) -> list[float]:
    """Start `members` (with their weights) under a fresh daemon on one shared window of `seconds`; their rates
    (each in its member's unit)."""
    work.mkdir(parents=True, exist_ok=True)
    daemon, sock = start_daemon(work, *args.serve_arg)
    procs, reports = [], []
    start_at = time.time() + args.warmup
    workloads = Workloads(tuple(shlex.split(args.workload)), tuple(shlex.split(args.render_workload)),
                          args.render_iterations)
    try:
        for i, (m, w) in enumerate(members):
            report = work / f"{label}-{i}.json"
            cmd = m.command(f"{label}-{i}", w * 100, sock, start_at, seconds, report, workloads)
            log = (work / f"{label}-{i}.log").open("wb")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=bench_env(), cwd=ROOT))
            reports.append(report)
        deadline = start_at + seconds + args.grace
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        stop_daemon(daemon, work, timeout_s=20)
    for r in reports:
        if not r.exists():
            raise SystemExit(f"{label}: no report {r} (logs in {work})")
    return rates_of([json.loads(r.read_text()) for r in reports], f"{label} (logs in {work})")


def rates_of(reports: list[dict[str, Any]], label: str) -> list[float]:
    """The members' rates from their reports: over the seconds all of them ran where one started late
    (scoring.common_window, as gpu_pairs scores a pair), else each over its window. A member that measured under
    half its window stops the run (scoring.short_window): a rate over a sliver of it is no measurement."""
    for i, rep in enumerate(reports):
        short = short_window(rep)
        if short:
            raise SystemExit(f"{label}: member {i} {short}")
    timelines = [(rep.get("window") or {}).get("timeline") or [] for rep in reports]
    window = common_window(timelines)
    if window is None:
        return [float(rep["throughput"]) for rep in reports]
    return list(rates_over(timelines, window))


def score(rates: list[float], solo: list[float], weights: tuple[int, int]) -> dict[str, object]:
    norm = [r / s for r, s in zip(rates, solo, strict=True)]
    return {"rates": rates, "normalized": [round(n, 4) for n in norm],
            "error_pts": round(error_points(norm, weights), 2), "sum": round(efficiency(norm), 4),
            "guarantee": guarantee_ok(norm, weights)}


def verdict(runs: list[dict[str, object]]) -> dict[str, object]:
    """Every round of one (pair, weights) against the bar: the median and worst error, the lowest sum, the
    guarantee in every round; each missed target says by how much."""
    errors = [float(r["error_pts"]) for r in runs]  # type: ignore[arg-type]
    sums = [float(r["sum"]) for r in runs]  # type: ignore[arg-type]
    med, worst, low = statistics.median(errors), max(errors), min(sums)
    missed = []
    if med > MAX_MEDIAN_ERROR_POINTS:
        missed.append(f"median error {med:.2f} pts > {MAX_MEDIAN_ERROR_POINTS:g} (by {med - MAX_MEDIAN_ERROR_POINTS:.2f})")
    if worst > MAX_ERROR_POINTS:
        missed.append(f"worst error {worst:.2f} pts > {MAX_ERROR_POINTS:g} (by {worst - MAX_ERROR_POINTS:.2f})")
    if low < MIN_CONTENDING_EFFICIENCY:
        missed.append(f"lowest sum {low:.3f} < {MIN_CONTENDING_EFFICIENCY:g} (by {MIN_CONTENDING_EFFICIENCY - low:.3f})")
    bad = sum(1 for r in runs if not r["guarantee"])
    if bad:
        missed.append(f"guarantee missed in {bad} of {len(runs)} rounds")
    return {"rounds": len(runs), "median_error_pts": round(med, 2), "worst_error_pts": round(worst, 2),
            "lowest_sum": round(low, 4), "median_sum": round(statistics.median(sums), 4),
            "passed": not missed, "missed": missed}


def report_md(result: dict[str, object]) -> str:
    meta = result["meta"]
    assert isinstance(meta, dict)
    lines = ["# Mixed-engine pairs", "", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Machine: {meta['machine']}  ", f"Commit: {meta['commit']}", "",
             f"Bar: error <= {MAX_MEDIAN_ERROR_POINTS:g} pt median and <= {MAX_ERROR_POINTS:g} worst, "
             f"sum >= {MIN_CONTENDING_EFFICIENCY:g}, guarantee in every round.", "",
             "| pair | weights | round | normalized | error (pts) | sum | guarantee |", "|---|---|---|---|---|---|---|"]
    runs: dict[str, list[dict[str, Any]]] = result["runs"]  # type: ignore[assignment]
    verdicts: dict[str, dict[str, Any]] = result["verdicts"]  # type: ignore[assignment]
    for key, rounds in runs.items():
        pair, weights = key.split(" ")
        for i, r in enumerate(rounds, 1):
            lines.append(f"| {pair} | {weights} | {i} | {' / '.join(f'{n:.3f}' for n in r['normalized'])} | "
                         f"{r['error_pts']:.2f} | {r['sum']:.3f} | {'yes' if r['guarantee'] else 'NO'} |")
    lines += ["", "| pair | weights | median error | worst error | lowest sum | verdict |", "|---|---|---|---|---|---|"]
    for key, v in verdicts.items():
        pair, weights = key.split(" ")
        lines.append(f"| {pair} | {weights} | {v['median_error_pts']:.2f} | {v['worst_error_pts']:.2f} | "
                     f"{v['lowest_sum']:.3f} | {'PASS' if v['passed'] else 'FAIL: ' + '; '.join(v['missed'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json and report.md")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with its own solo runs (default: 3)")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS,
                    help="pairs A+B, each of app, clientK (CUDA, K matmuls a step), render, frame (EGL), both of one "
                         f"engine (default: {DEFAULT_PAIRS})")
    ap.add_argument("--weights", default=DEFAULT_WEIGHTS, help=f"weights A:B (default: {DEFAULT_WEIGHTS})")
    ap.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                    help=f"measured window per run (default: {DEFAULT_SECONDS:g}); a pair with a long-step client gets "
                         "the window of mixed_pairs.WINDOW_CYCLES of its scheduling cycles when that is longer")
    ap.add_argument("--warmup", type=float, default=DEFAULT_WARMUP_S,
                    help=f"seconds from launch to the window (default: {DEFAULT_WARMUP_S:g})")
    ap.add_argument("--grace", type=float, default=20.0, help="seconds a run may overrun its window (default: 20)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `unisched serve` argument (repeatable)")
    ap.add_argument("--workload", default=shlex.join(Workloads().cuda),
                    help="the CUDA workload command (shell words; default: examples/workloads/cuda_matmul.py)")
    ap.add_argument("--render-workload", default=shlex.join(Workloads().render),
                    help="the render workload command (shell words; default: examples/workloads/egl_render.py)")
    ap.add_argument("--render-iterations", type=int, default=RENDER_ITERATIONS,
                    help=f"the render's --iterations, a frame's cost (default: {RENDER_ITERATIONS}, about 36 FPS "
                         "alone on the H200)")
    ap.add_argument("--logs", type=Path, default=None,
                    help="keep each run's daemon and workload logs under this folder (default: not kept); "
                         "bench/run.py keeps them in the run's archive")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, each member's command and exit")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.render_iterations < 1:
        ap.error("--rounds and --render-iterations must be at least 1")
    return args


def print_plan(args: argparse.Namespace, pairs: list[tuple[Member, Member]], weights: list[tuple[int, int]]) -> None:
    members, runs = members_of(pairs), plan(pairs, weights)
    minutes = args.rounds * round_seconds(pairs, weights, args.warmup, args.seconds) / 60
    print(f"{args.rounds} rounds x ({len(members)} alone + {len(runs)} pairs), about {minutes:.1f} min (an estimate "
          "from the warm-up, window and start/stop of each run)", flush=True)
    if not args.dry_run:
        return
    for a, b, w in runs:
        print(f"  {a.spec}+{b.spec} at {w[0]}:{w[1]}, a {window_s(a, b, w, args.seconds):.1f} s window")
    workloads = Workloads(tuple(shlex.split(args.workload)), tuple(shlex.split(args.render_workload)),
                          args.render_iterations)
    for m in members:
        argv = m.command("TENANT", 100, "SOCKET", 0.0, args.seconds, Path("REPORT"), workloads)
        print(f"  {m.spec} ({m.unit}), at weight 1: {shlex.join(argv)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pairs, weights = parse_pairs(args.pairs), parse_weights(args.weights)
    print_plan(args, pairs, weights)
    if args.dry_run:
        return 0
    host = machine()
    meta = {"command": " ".join(map(shlex.quote, sys.argv)), "commit": args.commit or tree_commit()["commit"],
            "machine": f"{host['host']}; {host['gpu'] or 'no GPU'}, {host['driver'] or '-'}; {host['cpu']}",
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "seconds": args.seconds,
            "serve_args": args.serve_arg}
    solos: list[dict[str, float]] = []
    runs: dict[str, list[dict[str, object]]] = {}
    verdicts: dict[str, dict[str, object]] = {}
    result: dict[str, object] = {"meta": meta, "solo": solos, "runs": runs, "verdicts": verdicts}
    work_root = Path(tempfile.mkdtemp(prefix="mixed-"))  # short: the daemon's socket path must fit (108 bytes)
    args.out.mkdir(parents=True, exist_ok=True)
    rc = run_rounds(args, pairs, weights, work_root, result)  # (a run that fails leaves it, for its logs)
    shutil.rmtree(work_root, ignore_errors=True)
    return rc


def run_logged(members: list[tuple[Member, int]], args: argparse.Namespace, work: Path, label: str,
               seconds: float) -> list[float]:
    """`run_together`, and its daemon's and workloads' logs copied under --logs (its own folder there), whether it
    succeeded or not: the work folder is temporary."""
    try:
        return run_together(members, args, work, label, seconds)
    finally:
        if args.logs is not None:
            (args.logs / work.name).mkdir(parents=True, exist_ok=True)
            for log in work.glob("*.log"):
                shutil.copy2(log, args.logs / work.name / log.name)


def run_rounds(args: argparse.Namespace, pairs: list[tuple[Member, Member]], weights: list[tuple[int, int]],
               work_root: Path, result: dict[str, Any]) -> int:
    """Every round: the members alone, then every pair at every weight; results.json and report.md after each run."""
    solos: list[dict[str, float]] = result["solo"]
    runs: dict[str, list[dict[str, object]]] = result["runs"]
    verdicts: dict[str, dict[str, object]] = result["verdicts"]
    for rnd in range(1, args.rounds + 1):
        solo = {}
        for m in members_of(pairs):
            (rate,) = run_logged([(m, 1)], args, work_root / f"r{rnd}-solo-{m.spec}", "solo", args.seconds)
            solo[m.spec] = rate
            print(f"round {rnd}: {m.spec} alone {rate:.1f} {m.unit}", flush=True)
        solos.append(solo)
        for k, (a, b, w) in enumerate(plan(pairs, weights), 1):
            label = f"r{rnd}-p{k}"
            rates = run_logged([(a, w[0]), (b, w[1])], args, work_root / f"{label}-{a.spec}+{b.spec}-{w[0]}_{w[1]}", "t",
                               window_s(a, b, w, args.seconds))
            s = score(rates, [solo[a.spec], solo[b.spec]], w)
            runs.setdefault(f"{a.spec}+{b.spec} {w[0]}:{w[1]}", []).append(s)
            print(f"round {rnd}: {a.spec}+{b.spec} {w[0]}:{w[1]} normalized {s['normalized']} error "
                  f"{s['error_pts']} pts sum {s['sum']}", flush=True)
            verdicts.update({key: verdict(rs) for key, rs in runs.items()})
            save_json(args.out / "results.json", result)  # every run, as it comes
            write_atomic(args.out / "report.md", report_md(result))
    print(report_md(result))
    return 0 if all(v["passed"] for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
