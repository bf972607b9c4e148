#!/usr/bin/env python3
"""The Grafana dashboard's main panels (deploy/grafana/unisched.json) drawn from a real run, for docs/metrics.md.

Why: the dashboard needs Prometheus and Grafana to be seen; this draws the same series, read from the same
/metrics a Prometheus would scrape, from a real daemon on this machine (root, real cgroups, no GPU: --no-nvml)
with CPU stand-ins as tenants (bench/cpu_standin.py pinned to one CPU, so they contend as two CUDA apps on one
GPU's SMs). Two tenants at weights 300 and 100 start together; a third at weight 100 joins for the middle
third and leaves. Each panel uses the dashboard's query on the scraped samples: measured share against target
(unisched_tenant_*_share_ratio), the part of the time frozen (unisched_tenant_state{state="frozen"} averaged over
a window) and GPU time charged per second (rate of unisched_tenant_gpu_seconds_total).

Usage (root): python3 bench/metrics_plot.py --out docs/metrics-cpu-standins.png  [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, bench_env, free_port, scrape, start_daemon, stop_daemon

SCRAPE_S = 1.0
"""Scrape interval: the metrics' own refresh (transport.metrics.REFRESH_S); a faster scrape reads each copy twice."""
WINDOW_S = 5.0
"""The window of the frozen-time and GPU-time panels ($__rate_interval on a 15 s scrape would be a minute)."""
TENANTS = (("a", 300, 0.0, 1.0), ("b", 100, 0.0, 1.0), ("c", 100, 1 / 3, 2 / 3))
"""(name, weight, start, end) with start and end as parts of the run."""


def start_tenant(sock: str, prefix: str, name: str, weight: int, seconds: float) -> subprocess.Popen[bytes]:
    burner = [sys.executable, str(ROOT / "bench" / "cpu_standin.py"), "--pin-cpu", "0", "--warmup", "0",
              "--seconds", f"{seconds:.1f}"]
    return subprocess.Popen([sys.executable, "-m", "unisched", "run", "--socket", sock, "--tenant", f"{prefix}{name}",
                             "--weight", str(weight), "--", *burner], env=bench_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


Series = dict[str, list[tuple[float, float]]]


def record(port: int, sock: str, prefix: str, seconds: float) -> tuple[Series, Series, Series, Series]:
    """Run the scenario, scraping every SCRAPE_S: (measured, target, frozen, gpu seconds) by tenant."""
    measured: Series = defaultdict(list)
    target: Series = defaultdict(list)
    frozen: Series = defaultdict(list)
    charged: Series = defaultdict(list)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    while (now := time.monotonic() - t0) < seconds:
        for name, weight, start, end in TENANTS:
            if name not in procs and now >= start * seconds:
                procs[name] = start_tenant(sock, prefix, name, weight, (end - start) * seconds - 1.0)
        for metric, labels, value in scrape(port):
            tenant = labels.get("tenant", "").removeprefix(prefix)
            if not tenant or labels.get("domain", "sm") != "sm":
                continue
            series = {"unisched_tenant_measured_share_ratio": measured, "unisched_tenant_target_share_ratio": target,
                      "unisched_tenant_gpu_seconds_total": charged}.get(metric)
            if metric == "unisched_tenant_state" and labels["state"] == "frozen":
                series = frozen
            if series is not None:
                series[tenant].append((now, value))
        time.sleep(SCRAPE_S)  # the scrape interval itself, as Prometheus keeps one
    for p in procs.values():
        p.wait(30)
    return measured, target, frozen, charged


def windowed(points: list[tuple[float, float]], rate: bool) -> list[tuple[float, float]]:
    """avg_over_time (rate=False) or rate (True) over WINDOW_S, at each sample."""
    out = []
    for i, (t, _) in enumerate(points):
        inside = [(u, w) for u, w in points[: i + 1] if u >= t - WINDOW_S]
        if rate:
            if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
                out.append((t, (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])))
        else:
            out.append((t, sum(w for _, w in inside) / len(inside)))
    return out


def plot(out: Path, measured: Series, target: Series, frozen: Series, charged: Series) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {"a": "tab:blue", "b": "tab:orange", "c": "tab:green"}
    weights = {name: w for name, w, _, _ in TENANTS}
    for tenant in sorted(measured):
        c, label = colors.get(tenant, "gray"), f"{tenant} (weight {weights.get(tenant, '?')})"
        axes[0].plot(*zip(*measured[tenant], strict=True), color=c, label=f"{label} measured")
        axes[0].plot(*zip(*target[tenant], strict=True), color=c, linestyle="--", label=f"{label} target")
        if frozen.get(tenant):
            axes[1].plot(*zip(*windowed(frozen[tenant], rate=False), strict=True), color=c, label=label)
        if len(charged.get(tenant, [])) > 2:
            axes[2].plot(*zip(*windowed(charged[tenant], rate=True), strict=True), color=c, label=label)
    axes[0].set_ylabel("share of gpu 0 / sm")
    axes[0].set_title("unisched_tenant_measured_share_ratio (solid) vs unisched_tenant_target_share_ratio (dashed)")
    axes[1].set_ylabel("part of the time")
    axes[1].set_title(f'avg_over_time(unisched_tenant_state{{state="frozen"}}[{WINDOW_S:.0f}s])')
    axes[2].set_ylabel("GPU s per s")
    axes[2].set_title(f"rate(unisched_tenant_gpu_seconds_total[{WINDOW_S:.0f}s])")
    axes[2].set_xlabel("seconds since the first tenant started")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.suptitle("unisched daemon, CPU stand-ins pinned to one CPU (bench/metrics_plot.py)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "metrics-cpu-standins.png")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the run (default: 60)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("metrics_plot.py: needs root (the daemon creates and freezes cgroups)")
    work = Path(tempfile.mkdtemp(prefix="us-plot-"))
    port = free_port()
    prefix = f"plot{os.getpid()}-"
    daemon, sock = start_daemon(work, "--no-nvml", "--metrics-port", str(port))
    try:
        series = record(port, sock, prefix, args.seconds)
    finally:
        stop_daemon(daemon, work)
        shutil.rmtree(work, ignore_errors=True)
    plot(args.out, *series)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
