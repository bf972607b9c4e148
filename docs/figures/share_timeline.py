#!/usr/bin/env python3
"""Share over time and who was frozen when, from a real daemon with CPU stand-ins, for docs/concepts.md.

Why: the scheduling model is easiest to see in one picture of a real run. This starts `unisched serve
--cpu-stand-in` (a CPU core plays GPU 0) on a private socket and cgroup subtree, runs two busy loops under
`unisched run` pinned to one core (they contend as two CUDA apps on one GPU's SMs), and records:
- each tenant's CPU time (its cgroup's cpu.stat), as a share of the core per window: what it really got;
- each tenant's freezer state (cgroup.events `frozen`), every SAMPLE_S: who was frozen when;
- the daemon's target share for each tenant (ListTenants), every TARGET_S.

The story: `b` (weight 100) runs alone, is never frozen and gets the whole core; `a` (weight 300) joins and they
take turns 3:1; `a`'s weight is set to 100 and they go 1:1; `a` exits and `b` has everything again at once.

Usage (root, cgroup v2 freezer): python3 docs/figures/share_timeline.py [--core N] [--out PNG]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_S = 0.01
"""Freezer and CPU sampling period: a fifth of a 50 ms slice, so each frozen stretch shows."""
TARGET_S = 0.5
"""How often the daemon's target shares are read (they change only on joins, exits and weight changes)."""
WINDOW_S = 1.0
"""Window of the share-of-core curve: 20 slices, short enough to show a join within a second."""
HOG_NICE = "-15"
"""The busy loops' nice value: they take their core from the host's other work (a shared build machine's), as a
CUDA app has its GPU to itself; at nice 0 the tenants do not saturate the core, the daemon's saturation gate rightly
leaves it open, and nobody is frozen."""
SATURATED_UTIL = "0.9"
"""The daemon's saturation gate for this run (default 0.98): on a shared host the tenants alone rarely keep a core
98% busy (the daemon, the sampler and the host's own threads take a few percent), and below the gate the daemon
rightly lets both run instead of slicing. A GPU's busy fraction has no such neighbours."""
EVENTS = ((0.0, "start b 100"), (0.2, "start a 300"), (0.5, "set a 100"), (0.8, "stop a"))
"""(part of the run, what happens); the run ends at 1.0."""


def hog(core: int) -> list[str]:
    """An unmodified busy loop pinned to `core`: the stand-in for a CUDA app that keeps its GPU busy."""
    return ["nice", "-n", HOG_NICE, "taskset", "-c", str(core), "sh", "-c", "while :; do :; done"]


@dataclass
class Trace:
    """One tenant's samples: (t, cpu seconds), (t, frozen), (t, target share)."""

    cpu: list[tuple[float, float]] = field(default_factory=list)
    frozen: list[tuple[float, bool]] = field(default_factory=list)
    target: list[tuple[float, float]] = field(default_factory=list)


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients")])}


def cgroup2_mount() -> Path:
    for line in Path("/proc/mounts").read_text().splitlines():
        kind, mount = line.split()[2], line.split()[1]
        if kind == "cgroup2":
            return Path(mount)
    raise SystemExit("share_timeline.py: needs a cgroup v2 hierarchy (the v2 freezer)")


def unisched(sock: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "unisched", *args[:1], "--socket", sock, *args[1:]]


def start_daemon(work: Path, subtree: str) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(work / "unisched.sock")
    log = (work / "daemon.log").open("wb")
    daemon = subprocess.Popen(unisched(sock, "serve", "--state-dir", str(work / "state"), "--cpu-stand-in",
                                       "--cgroup-driver", "v2", "--cgroup-subtree", subtree,
                                       "--saturated-util", SATURATED_UTIL),
                              stdout=log, stderr=log, env=env(), cwd=ROOT)
    deadline = time.monotonic() + 30
    while not Path(sock).exists():
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            raise SystemExit(f"unisched serve did not come up:\n{(work / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return daemon, sock


def read_cgroup(path: Path) -> tuple[float, bool] | None:
    """(cpu seconds, frozen) of a v2 cgroup, or None while it is not there."""
    try:
        stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
        events = dict(line.split() for line in (path / "cgroup.events").read_text().splitlines())
    except (FileNotFoundError, ValueError):
        return None
    return int(stat["usage_usec"]) / 1e6, events.get("frozen") == "1"


def record(sock: str, tree: Path, seconds: float, core: int) -> dict[str, Trace]:
    from unisched.transport.client import DaemonClient

    traces = {name: Trace() for name in ("a", "b")}
    pending = list(EVENTS)
    procs: list[subprocess.Popen[bytes]] = []
    client = DaemonClient(socket=sock)
    t0 = time.monotonic()
    next_target = 0.0
    while (now := time.monotonic() - t0) < seconds:
        while pending and now >= pending[0][0] * seconds:
            _, what = pending.pop(0)
            verb, name, *weight = what.split()
            if verb == "start":
                procs.append(subprocess.Popen(unisched(sock, "run", "--tenant", name, "--weight", weight[0], "--",
                                                       *hog(core)), env=env(), cwd=ROOT, stdout=subprocess.DEVNULL))
            elif verb == "set":
                client.set_weight(name, int(weight[0]))
            else:
                procs[-1].terminate()  # `unisched run` forwards it to the loop; the tenant goes with its process
        for name, trace in traces.items():
            seen = read_cgroup(tree / name)
            if seen is not None:
                trace.cpu.append((now, seen[0]))
                trace.frozen.append((now, seen[1]))
        if now >= next_target:
            next_target = now + TARGET_S
            shown = {t.name: t.target_share for t in client.tenants()}
            for name, trace in traces.items():
                trace.target.append((now, shown.get(name, 0.0)))
        time.sleep(SAMPLE_S)  # the sampling period itself
    for p in procs:
        p.terminate()
        p.wait(30)
    client.close()
    return traces


def shares(cpu: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Share of the core over the WINDOW_S before each sample."""
    out, j = [], 0
    for t, used in cpu:
        while cpu[j][0] < t - WINDOW_S:
            j += 1
        if t - cpu[j][0] >= WINDOW_S / 2:
            out.append((t, (used - cpu[j][1]) / (t - cpu[j][0])))
    return out


def frozen_spans(frozen: list[tuple[float, bool]]) -> list[tuple[float, float]]:
    """(start, length) of each stretch sampled frozen."""
    spans, start = [], None
    for t, f in frozen:
        if f and start is None:
            start = t
        elif not f and start is not None:
            spans.append((start, t - start))
            start = None
    if start is not None and frozen:
        spans.append((start, frozen[-1][0] - start))
    return spans


ZOOMS = ((0.35, "3:1"), (0.65, "1:1"))
"""(part of the run, label) of the ZOOM_S stretches drawn slice by slice below the whole run."""
ZOOM_S = 1.0


def frozen_rows(ax: Any, traces: dict[str, Trace], colors: dict[str, str]) -> None:
    for row, (name, trace) in enumerate(sorted(traces.items())):
        ax.broken_barh(frozen_spans(trace.frozen), (row + 0.1, 0.8), color=colors[name])
    ax.set_yticks([0.5, 1.5], [f"{n} frozen" for n in sorted(traces)])
    ax.set_ylim(0, 2)


def plot(out: Path, traces: dict[str, Trace], seconds: float, core: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"a": "tab:blue", "b": "tab:orange"}
    fig = plt.figure(figsize=(10, 7.5))
    grid = fig.add_gridspec(3, 2, height_ratios=[3, 1.1, 1.1])
    top, low = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, :])
    for name, trace in traces.items():
        if trace.cpu:
            top.plot(*zip(*shares(trace.cpu), strict=True), color=colors[name], label=f"{name}: share of core {core}")
        if trace.target:
            top.step(*zip(*trace.target, strict=True), where="post", color=colors[name], linestyle="--",
                     label=f"{name}: target share")
    frozen_rows(low, traces, colors)
    for part, what in EVENTS:
        for ax in (top, low):
            ax.axvline(part * seconds, color="gray", linewidth=0.8, linestyle=":")
        top.annotate(what, (part * seconds, 1.04), fontsize=8, color="dimgray")
    top.set_ylim(-0.02, 1.12)
    top.set_ylabel(f"share of GPU 0 (core {core})")
    top.legend(loc="center right", fontsize=8)
    top.grid(alpha=0.3)
    for ax in (top, low):
        ax.set_xlim(0, seconds)
    low.set_xlabel("seconds (shaded: the two stretches drawn below, slice by slice)")
    for col, (part, label) in enumerate(ZOOMS):
        ax = fig.add_subplot(grid[2, col])
        frozen_rows(ax, traces, colors)
        start = part * seconds
        ax.set_xlim(start, start + ZOOM_S)
        ax.set_title(f"{ZOOM_S:.0f} s at {label}, slice by slice", fontsize=9)
        low.axvspan(start, start + ZOOM_S, color="gray", alpha=0.25)
    fig.suptitle(f"unisched serve --cpu-stand-in: two busy loops under `unisched run`, pinned to core {core}")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


def remove_subtree(tree: Path) -> None:
    for d in [*sorted(tree.rglob("*"), key=lambda p: len(p.parts), reverse=True), tree]:
        if d.is_dir():
            try:
                d.rmdir()
            except OSError as e:
                print(f"share_timeline.py: left {d}: {e.strerror}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures" / "share-over-time.png")
    parser.add_argument("--core", type=int, default=0,
                        help="the core the tenants are pinned to, playing GPU 0: pick the host's quietest (default 0)")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of the run (default: 40)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("share_timeline.py: needs root (the daemon creates and freezes cgroups)")
    subtree = f"unisched-figure-{os.getpid()}"
    tree = cgroup2_mount() / subtree
    work = Path(tempfile.mkdtemp(prefix="us-figure-"))
    daemon, sock = start_daemon(work, subtree)
    try:
        traces = record(sock, tree, args.seconds, args.core)
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(work, ignore_errors=True)
        remove_subtree(tree)
    plot(args.out, traces, args.seconds, args.core)
    frozen = {n: sum(f for _, f in t.frozen) / max(1, len(t.frozen)) for n, t in traces.items()}
    print(f"wrote {args.out}; part of its samples frozen: {frozen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
