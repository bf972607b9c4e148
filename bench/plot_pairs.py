#!/usr/bin/env python3
"""Plot committed gpu_pairs runs: normalized throughput against the weights, and each unisched run's shares over time.

Why: gpu_pairs (--repeat rounds too) writes tables only.
Reads each folder's results.json (a gpu_pairs --out folder, or a rounds folder, whose round-K/ subfolders are
plotted) and writes PNGs under its plots/. Needs matplotlib.

    python3 bench/plot_pairs.py bench/results/2026-12-01-h200-g/call-d-kernel-matmul/rounds-kernel-matmul
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scoring  # (bench/ is not a package)
from _results import save_plot


def workloads(meta: dict[str, Any]) -> tuple[str, tuple[str, str]]:
    """What the pair ran, for titles and legends, from the command lines gpu_pairs recorded."""
    cmd = meta.get("workload_cmd") or {}
    cuda = " ".join(cmd.get("cuda") or [])
    if "cuda_matmul" in cuda:
        return "CUDA matmul + EGL render", ("matmul", "render")
    batch = cuda.split("--batch", 1)[1].split()[0] if "--batch" in cuda else "32"
    return f"ResNet-50 b{batch} training + EGL render", ("training", "render")


def share_series(reports: list[dict[str, Any] | None], solo: list[float | None], step: float = 1.0
                 ) -> tuple[list[float], list[list[float]]]:
    """Each tenant's share of the summed normalized throughput, per `step` seconds, from the report timelines."""
    rates: list[dict[int, float]] = []
    for rep, base in zip(reports, solo, strict=True):
        tl = ((rep or {}).get("window") or {}).get("timeline") or []
        bins: dict[int, float] = {}
        for (t0, n0), (t1, n1) in itertools.pairwise(tl):
            if t1 > t0 and base:
                bins[int(t1 // step)] = bins.get(int(t1 // step), 0.0) + (n1 - n0) / base
        rates.append(bins)
    keys = sorted(set().union(*rates)) if rates else []
    times = [k * step for k in keys]
    shares_: list[list[float]] = [[] for _ in rates]
    for k in keys:
        total = sum(r.get(k, 0.0) for r in rates)
        for i, r in enumerate(rates):
            shares_[i].append(r.get(k, 0.0) / total if total else 0.0)
    return times, shares_


def mixed_plots(plt: Any, res: dict[str, Any], engine: str, folder: Path,
                what: str = "ResNet-50 training + EGL render", names: tuple[str, str] = ("training", "render")
                ) -> list[Path]:
    """From a gpu_pairs results.json: normalized throughput against the weights, and each unisched run's shares
    over time (`what` and `names` say which workloads the pair ran)."""
    made: list[Path] = []
    pairs = res.get("pairs") or []
    if pairs:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels: list[tuple[float, str]] = []
        xs = 0.0
        for p in pairs:
            w = p["weights"]
            want = scoring.shares(w)
            for setup in ("no_scheduler", "unisched"):
                s = p.get(setup) or {}
                n = s.get("normalized")
                if not n:
                    continue
                ax.bar([xs, xs + 0.4], n, width=0.4, color=["tab:blue", "tab:orange"])
                ax.plot([xs - 0.2, xs + 0.6], [want[0] * s.get("efficiency", 1)] * 2, "k--", lw=0.8)
                labels.append((xs + 0.2, f"{w[0]:g}:{w[1]:g}\n{'none' if setup == 'no_scheduler' else 'unisched'}"))
                xs += 1.2
        ax.set_xticks([x for x, _ in labels], [lab for _, lab in labels], fontsize=8)
        ax.set_ylabel(f"normalized throughput (blue: {names[0]}, orange: {names[1]})")
        ax.set_title(f"{what}, {engine} engine (dashed: {names[0]}'s weighted share of the sum)")
        made.append(save_plot(plt, fig, folder / f"mixed-{engine}-normalized.png"))
    for key, run in (res.get("unisched") or {}).items():
        tenants = run.get("tenants") or []
        if len(tenants) != 2:
            continue
        pair = next((p for p in pairs if p["pair"] == key), None)
        if pair is None:
            continue
        times, sh = share_series([t.get("report") for t in tenants], pair["solo"])
        if not times:
            continue
        want = scoring.shares(pair["weights"])
        fig, ax = plt.subplots(figsize=(7, 3))
        for (name, series), target in zip(zip(names, sh, strict=True), want, strict=True):
            line = ax.plot(times, series, label=f"{name} (target {target:.2f})")[0]
            ax.axhline(target, color=line.get_color(), ls="--", lw=0.8)
        ax.set_ylim(0, 1)
        ax.set_xlabel("seconds into the window")
        ax.set_ylabel("share of normalized throughput")
        ax.set_title(f"{key}, {engine} engine: share over time")
        ax.legend(fontsize=8)
        made.append(save_plot(plt, fig, folder / f"mixed-{engine}-{re.sub(r'[^A-Za-z0-9]+', '-', key)}-share.png"))
    return made


def plot_folder(folder: Path) -> list[Path]:
    path = folder / "results.json"
    if not path.is_file():
        raise SystemExit(f"{folder}: no results.json (a gpu_pairs --out folder or a rounds folder)")
    res = json.loads(path.read_text())
    rounds = sorted(p for p in folder.glob("round-*") if (p / "results.json").is_file())
    if rounds and "unisched" not in res:  # a rounds summary: its runs are in the rounds
        return [png for r in rounds for png in plot_folder(r)]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("matplotlib is needed: python3 -m pip install matplotlib") from None
    meta = res.get("meta") or {}
    what, names = workloads(meta)
    (folder / "plots").mkdir(exist_ok=True)
    return mixed_plots(plt, res, str(meta.get("engine", "kernel")), folder / "plots", what, names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("folders", nargs="+", type=Path, help="gpu_pairs --out folders or rounds folders")
    args = ap.parse_args(argv)
    for folder in args.folders:
        for png in plot_folder(folder):
            print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
