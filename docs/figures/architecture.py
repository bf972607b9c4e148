#!/usr/bin/env python3
"""The architecture diagram of the README (docs/figures/architecture.png), drawn with matplotlib.

Why a script: the picture must render on the repository page (a PNG does) and be changed by editing a source file,
not by hand in a drawing tool; matplotlib is already what the other figures use, so no Graphviz is needed.

Usage: python3 docs/figures/architecture.py [--out docs/figures/architecture.png]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "architecture.png"
TENANT, DAEMON, PART, GPU, SOCKET = "#fde9c8", "#eef3fb", "#ffffff", "#d9f0d3", "#fff7a8"
"""Fill colours: tenants, the daemon, its parts, the GPU side, the daemon's sockets."""


@dataclass(frozen=True)
class Box:
    """A labelled rectangle; `x, y` its lower left corner, in the figure's 0..15 x 0..8 units."""

    x: float
    y: float
    w: float
    h: float
    text: str
    fill: str = PART
    bold: bool = False

    def left(self, at: float = 0.5) -> tuple[float, float]:
        return (self.x, self.y + self.h * at)

    def right(self, at: float = 0.5) -> tuple[float, float]:
        return (self.x + self.w, self.y + self.h * at)

    def top(self, at: float = 0.5) -> tuple[float, float]:
        return (self.x + self.w * at, self.y + self.h)

    def bottom(self, at: float = 0.5) -> tuple[float, float]:
        return (self.x + self.w * at, self.y)


CLI = Box(0.5, 6.3, 3.3, 1.2,
          "CLI: unisched run, tenants,\nset-weight, set-limit, adopt, top;\nKubernetes device plugin, DRA driver", TENANT)
APP = Box(0.5, 3.6, 3.3, 1.9, "unmodified app or container\n(CUDA, OpenGL/EGL/Vulkan, NVDEC/NVENC)\nin its tenant's cgroup\n\n"
          "freezer enforcement", TENANT, bold=True)
COOP = Box(0.5, 1.2, 3.3, 1.9, "cooperative app\n+ unisched_client\n(Client.step(), FrameGate, gates)\n\n"
           "lease enforcement", TENANT, bold=True)
DAEMON_BOX = Box(4.4, 1.0, 6.4, 6.7, "", DAEMON)
GRPC = Box(4.55, 6.5, 1.4, 0.8, "unisched.sock\ngRPC API", SOCKET)
AGENT = Box(4.55, 4.0, 1.4, 1.0, "seccomp agent\nsockets: runs',\nruntimes' own", SOCKET)
LEASE = Box(4.55, 1.75, 1.4, 0.8, "lease.sock\nlease stream", SOCKET)
API = Box(6.15, 6.4, 2.4, 1.0, "register, weights, caps,\nadopt, status (admin checks)")
FREEZE = Box(6.15, 3.6, 2.4, 1.9, "freeze / thaw cgroups\n\nseccomp hooks: admit\nsessions, count memory\n\ndevice eBPF, MPS")
LEASES = Box(6.15, 1.3, 2.4, 1.7, "grant, revoke, renew leases\n\ncharged with the GPU time\nthe client measured")
TELEMETRY = Box(8.75, 6.4, 1.9, 1.0, "NVML utilization\n(or one CPU core:\n--cpu-stand-in)")
SCHED = Box(8.75, 1.3, 1.9, 4.7, "Scheduler\n\nevery slice (50 ms):\nmeasure\nobserve\ndecide\nplan\napply\n\n"
            "policy (pure):\nfair share by weight,\nsaturation gate,\noverlap", bold=False)
GPU_BOX = Box(11.5, 2.2, 3.3, 3.0, "NVIDIA GPU\n\nSMs: compute, graphics\nNVDEC, NVENC\nvideo memory", GPU, bold=True)
OUTPUTS = Box(11.5, 6.3, 3.3, 1.2, "/metrics, /healthz, /readyz\nstate.json (tenants, weights)\nJSON log lines", GPU)
BUS_Y = 0.45
"""The GPU work's path, under the daemon: apps reach the driver directly, never through the daemon."""


def draw_box(ax: Any, box: Box) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((box.x, box.y), box.w, box.h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=box.fill, edgecolor="#555555", linewidth=1.0))
    if box.text:
        ax.text(box.x + box.w / 2, box.y + box.h / 2, box.text, ha="center", va="center", fontsize=8.2,
                fontweight="bold" if box.bold else "normal", linespacing=1.35)


def arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], label: str = "", both: bool = False,
          dashed: bool = False, color: str = "#333333", label_at: tuple[float, float] | None = None) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={
        "arrowstyle": "<|-|>" if both else "-|>", "color": color, "linewidth": 1.2,
        "linestyle": "--" if dashed else "-", "shrinkA": 2, "shrinkB": 2})
    if label:
        x, y = label_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.14)
        ax.text(x, y, label, ha="center", va="bottom", fontsize=7.2, color=color, style="italic")


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(15, 8))
    ax.set_xlim(0, 15)
    ax.set_ylim(0, 8)
    ax.axis("off")
    for box in (DAEMON_BOX, CLI, APP, COOP, GRPC, AGENT, LEASE, API, FREEZE, LEASES, TELEMETRY, SCHED, GPU_BOX,
                OUTPUTS):
        draw_box(ax, box)
    ax.text(DAEMON_BOX.x + 0.12, DAEMON_BOX.y + 0.08, "unisched serve (root daemon)", ha="left", va="bottom",
            fontsize=10, fontweight="bold", color="#2b4a7a")
    arrow(ax, CLI.right(), GRPC.left(0.6), "gRPC; caller\nfrom SO_PEERCRED", label_at=(4.15, 7.0))
    arrow(ax, APP.right(0.8), AGENT.left(0.7), "GPU session ioctls:\nadmit or refuse", label_at=(4.1, 5.15))
    arrow(ax, FREEZE.left(0.12), APP.right(0.12), "freeze / thaw", label_at=(4.4, 3.85))
    arrow(ax, COOP.right(0.5), LEASE.left(0.5), "want, grant, renew,\nrevoke, yield", both=True, label_at=(4.1, 2.3))
    arrow(ax, GRPC.right(), API.left(0.6))
    arrow(ax, AGENT.right(), FREEZE.left(0.7))
    arrow(ax, LEASE.right(), LEASES.left(0.6))
    arrow(ax, API.right(0.3), SCHED.left(0.97))
    arrow(ax, SCHED.left(0.6), FREEZE.right(0.5), "plan", label_at=(8.65, 4.6))
    arrow(ax, SCHED.left(0.12), LEASES.right(0.4), "plan", label_at=(8.65, 2.0))
    arrow(ax, TELEMETRY.bottom(), SCHED.top(), "measure", label_at=(10.1, 6.05))
    arrow(ax, GPU_BOX.left(0.85), TELEMETRY.right(0.3), "busy fraction", label_at=(11.0, 5.75))
    arrow(ax, DAEMON_BOX.right(0.9), OUTPUTS.left(0.45))
    green = "#2e7d32"
    x_left = 0.25
    for box in (APP, COOP):  # each tenant's GPU work joins the bus on the left, under the daemon, to the GPU
        ax.plot([box.x, x_left], [box.y + 0.35, box.y + 0.35], color=green, linestyle="--", linewidth=1.2)
    ax.plot([x_left, x_left, GPU_BOX.bottom(0.5)[0]], [APP.y + 0.35, BUS_Y, BUS_Y], color=green, linestyle="--",
            linewidth=1.2)
    arrow(ax, (GPU_BOX.bottom(0.5)[0], BUS_Y), GPU_BOX.bottom(0.5), dashed=True, color=green)
    ax.text(7.6, BUS_Y + 0.06, "GPU work goes straight to the NVIDIA driver, unchanged: never through the daemon",
            ha="center", va="bottom", fontsize=8, color=green, style="italic")
    ax.set_title("unisched: one weight per tenant over every GPU engine it uses", fontsize=13, loc="left")
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    draw(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
