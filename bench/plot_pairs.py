#!/usr/bin/env python3
"""Plot committed gpu_pairs runs: normalized throughput against the weights, and each unisched run's shares over time.

Why: bench/scenarios.py plots the pairs it runs, but gpu_pairs itself (--repeat rounds too) writes tables only.
Reads each folder's results.json (a gpu_pairs --out folder, or a rounds folder, whose round-K/ subfolders are
plotted) and writes PNGs under its plots/. Needs matplotlib.

    python3 bench/plot_pairs.py bench/results/2026-12-01-h200-g/call-d-kernel-matmul/rounds-kernel-matmul
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scenarios  # (bench/ is not a package)


def workloads(meta: dict[str, Any]) -> tuple[str, tuple[str, str]]:
    """What the pair ran, for titles and legends, from the command lines gpu_pairs recorded."""
    cmd = meta.get("workload_cmd") or {}
    cuda = " ".join(cmd.get("cuda") or [])
    if "cuda_matmul" in cuda:
        return "CUDA matmul + EGL render", ("matmul", "render")
    batch = cuda.split("--batch", 1)[1].split()[0] if "--batch" in cuda else "32"
    return f"ResNet-50 b{batch} training + EGL render", ("training", "render")


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
    return scenarios.mixed_plots(plt, res, str(meta.get("engine", "kernel")), folder / "plots", what, names)


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
