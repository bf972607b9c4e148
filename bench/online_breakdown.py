#!/usr/bin/env python3
"""Where an online request's time goes: its own service time, or waiting behind the request before it.

Why: the online example answers Poisson arrivals one at a time and times each request from its ARRIVAL, so its p99
mixes two things: how long the GPU took for it (what a scheduler changes) and how long it queued behind an earlier
answer (which a slower answer lengthens, and which moves with the arrival bursts). On the H200 the alone p99 is over
twice the alone p50 and the same setup's p99 moves 0.15-0.3x between rounds (bench/results/2026-12-01-h200-i/).
From each request's arrival a and latency L in a scenarios.py results.json: its answer ends at c = a + L, it starts
at max(a, previous c), and its service time is c - start. Reports per setup, pooled over rounds, the p50/p99 of
latency and of service time against alone, and how many requests queued. A diagnosis, not the issue's target.

  python3 bench/online_breakdown.py bench/results/2026-12-01-h200-i/call-b/online-probe/results.json [more.json ...]
  python3 bench/online_breakdown.py --batch 8 bench/results/2026-12-02-h200-a/call-c/online-probe/results.json

Interleaved runs (scenarios.py --interleave) get a second table: running / paused, their pairs of periods pooled
over every file given, each setup's trainer kept per run, and the target's verdict on the pool (the pooled p99 ratio
and the lowest kept; where met, whether the p99's 90% interval settles it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "workloads"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import online_report
import online_scoring
from _window import percentile
from interleave import Block

ALONE = "alone-online"


@dataclass(frozen=True)
class Breakdown:
    latency_ms: tuple[float, ...]
    service_ms: tuple[float, ...]
    queued: int
    """Requests that arrived before the previous answer ended."""


def breakdown(arrivals_s: Sequence[float], latencies_ms: Sequence[float]) -> Breakdown:
    """Arrivals in order, each with its latency; service = end - max(arrival, previous end)."""
    if len(arrivals_s) != len(latencies_ms):
        raise ValueError(f"{len(arrivals_s)} arrivals but {len(latencies_ms)} latencies")
    service: list[float] = []
    queued = 0
    prev_end = float("-inf")
    for a, lat in zip(arrivals_s, latencies_ms, strict=True):
        end = a + lat / 1000.0
        if prev_end > a:
            queued += 1
        service.append(1000.0 * (end - max(a, prev_end)))
        prev_end = end
    return Breakdown(tuple(latencies_ms), tuple(service), queued)


def batch_runs(results: dict[str, Any], batch: int) -> dict[str, Any]:
    """One online batch size's runs (its first round, `more_rounds` and `derived`) in a results.json; {} if none."""
    return results.get("scenarios", {}).get("online", {}).get("batches", {}).get(str(batch)) or {}


def online_runs(results: dict[str, Any], batch: int = 1) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(setup, run, the online tenant's report) for every run of every round of one batch size in a results.json."""
    runs = batch_runs(results, batch)
    if not runs:
        return
    for rnd in [runs, *runs.get("more_rounds", [])]:
        for setup, run in rnd.items():
            if not isinstance(run, dict) or "tenants" not in run:
                continue
            for t in run["tenants"]:
                rep = t.get("report") or {}
                if "latencies_ms" in rep and "arrivals_s" in rep:
                    yield setup, run, rep


def pooled(paths: Sequence[Path], batch: int = 1) -> dict[str, list[Breakdown]]:
    out: dict[str, list[Breakdown]] = {}
    for p in paths:
        for setup, _, rep in online_runs(json.loads(p.read_text()), batch):
            out.setdefault(setup, []).append(breakdown(rep["arrivals_s"], rep["latencies_ms"]))
    return out


def interleaved_kept(results: dict[str, Any], batch: int = 1) -> Iterator[tuple[str, float | None]]:
    """(setup, the trainer's kept over its running periods) for every interleaved run of every round, as the
    results' own derivation scored it (each round against its own solo run)."""
    for _, setup, s in online_report.interleaved_setups(batch_runs(results, batch)):
        yield setup, s.get("offline_kept")


def interleaved_table(paths: Sequence[Path], batch: int = 1) -> str:
    """Interleaved runs (scenarios.py --interleave) of every file, pooled per setup: running / paused ratios with
    90% intervals from resampling their pairs of periods (interleave.paired_bootstrap), so calls add up; beside
    them the trainer's kept of each run, since the target asks for both, and the verdict: the pooled p99 and the
    lowest kept against the target, and whether the p99's interval settles it."""
    blocks: dict[str, list[Block]] = {}
    kept: dict[str, list[float | None]] = {}
    for p in paths:
        results = json.loads(p.read_text())
        for setup, run, _ in online_runs(results, batch):
            pairs = online_scoring.run_pairs(run)  # [] for a run without pauses: that setup gets no row from it
            if pairs:
                blocks.setdefault(setup, []).extend(pairs)
        for setup, k in interleaved_kept(results, batch):
            kept.setdefault(setup, []).append(k)
    if not blocks:
        return ""
    lines = ["| setup (interleaved) | pairs of periods | requests running / paused | p50 running / paused | "
             "mean running / paused | p99 running / paused | trainer kept (per run) | target |",
             "|---|---|---|---|---|---|---|---|"]
    for setup, bs in sorted(blocks.items()):
        running = [v for b in bs for v in b[0]]
        idle = [v for b in bs for v in b[1]]
        r = online_scoring.interleaved_ratios(running, idle, bs)
        cells = []
        for name in online_scoring.INTERLEAVED_STATS:
            x, ci = r[f"{name}_x"], r[f"{name}_x_ci"]
            cells.append(f"{x:.2f}" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""))
        p99x, p99_ci = r["p99_x"], r["p99_x_ci"]
        ks = kept.get(setup, [])
        known = [k for k in ks if k is not None]
        met = online_scoring.online_target_met(p99x, min(known) if known else None)
        verdict = {True: "**met**", False: "missed", None: "n/a"}[met]
        # met at the point: by how much (the column's 1.05 can be either side of the target) and whether the
        # interval settles it
        if met and p99_ci:
            verdict += f" (p99 {p99x:.3f}x, {online_scoring.p99_resolution(p99_ci)})"
        lines.append(f"| {setup} | {len(bs)} | {len(running)} / {len(idle)} | {' | '.join(cells)} | "
                     f"{', '.join('n/a' if k is None else f'{k:.2f}' for k in ks) or 'n/a'} | {verdict} |")
    return "\n".join(lines)


def table(runs: dict[str, list[Breakdown]]) -> str:
    if ALONE not in runs:
        raise ValueError("no alone-online run in these results: nothing to compare against")

    def stats(bs: list[Breakdown]) -> tuple[float, float, float, float, int, int]:
        lat = [v for b in bs for v in b.latency_ms]
        svc = [v for b in bs for v in b.service_ms]
        return (percentile(lat, 50), percentile(lat, 99), percentile(svc, 50), percentile(svc, 99),
                sum(b.queued for b in bs), len(lat))

    base = stats(runs[ALONE])
    lines = ["| setup | runs | requests | queued | latency p50 / p99 ms | p99 / alone | service p50 / p99 ms | "
             "service p99 / alone |", "|---|---|---|---|---|---|---|---|"]
    for setup in [ALONE, *sorted(s for s in runs if s != ALONE)]:
        lp50, lp99, sp50, sp99, queued, n = stats(runs[setup])
        lines.append(f"| {setup} | {len(runs[setup])} | {n} | {100.0 * queued / n:.1f}% | {lp50:.2f} / {lp99:.2f} | "
                     f"{lp99 / base[1]:.2f}x | {sp50:.2f} / {sp99:.2f} | {sp99 / base[3]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Pools every round of every file given; setups are named as in the files.")
    ap.add_argument("results", nargs="+", type=Path, help="bench/scenarios.py results.json files (online scenario)")
    ap.add_argument("--batch", type=int, default=1, help="which online batch size to read (default 1)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    try:
        print(table(pooled(args.results, args.batch)))
        inter = interleaved_table(args.results, args.batch)
        if inter:
            print("\n" + inter)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"online_breakdown: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
