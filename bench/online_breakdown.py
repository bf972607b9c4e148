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
from _window import percentile

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


def online_reports(results: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(setup, the online tenant's report) for every run of every round of batch-1 runs in a results.json."""
    for batch in results.get("scenarios", {}).get("online", {}).get("batches", {}).values():
        rounds = [batch, *batch.get("more_rounds", [])]
        for rnd in rounds:
            for setup, run in rnd.items():
                if not isinstance(run, dict) or "tenants" not in run:
                    continue
                for t in run["tenants"]:
                    rep = t.get("report") or {}
                    if "latencies_ms" in rep and "arrivals_s" in rep:
                        yield setup, rep


def pooled(paths: Sequence[Path]) -> dict[str, list[Breakdown]]:
    out: dict[str, list[Breakdown]] = {}
    for p in paths:
        for setup, rep in online_reports(json.loads(p.read_text())):
            out.setdefault(setup, []).append(breakdown(rep["arrivals_s"], rep["latencies_ms"]))
    return out


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
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.results if not p.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    try:
        print(table(pooled(args.results)))
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"online_breakdown: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
