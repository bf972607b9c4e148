#!/usr/bin/env python3
"""Registration load: while one local process registers again and again, how long do other callers wait?

Each `Register` moves the caller's process into its tenant's cgroup: a write to cgroup.procs, which waits for the
kernel (an RCU grace period, milliseconds). Any local user may register, so the daemon must not make everyone else
wait while it moves someone. Here a registrar process registers back to back for --seconds, alternating between two
tenants so that every registration is a real move, while this process times `Status` round trips to the same
daemon, first --warmup seconds alone and then during the registrations. The report gives both, how many
registrations were made and how long each took, and how often the daemon warned that its slice loop ran late.
With --root DIR the daemon and the registrar run from another checkout (to compare with an older commit). CPU only
(the daemon runs with --no-nvml); needs root, since the moves are real.

  python3 bench/registration_load.py --out DIR
  python3 bench/registration_load.py --root /tmp/old-checkout --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _daemon import ROOT, remove_subtree, start_daemon
from _results import header, run_info, write
from lease_load import percentile

sys.path[:0] = [str(ROOT), str(ROOT / "clients")]

TENANTS = ("reg-a", "reg-b")
"""The registrar alternates between these, so that each registration moves it."""
LATE_WARNING = "slice loop ran late"
"""What the daemon logs when its event loop started a slice late."""
REPLY_S = 120.0
"""The registrar must answer within this long, or the run gives up."""

REGISTRAR = r"""
import json, statistics, sys, time
from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb
sock, tenants = sys.argv[1], sys.argv[2].split(",")
with DaemonClient(sock, timeout=30) as c:
    c.register(pb.RegisterRequest(tenant=tenants[0], keep=True))  # connected, imported, in a tenant
    print("ready", flush=True)
    seconds = float(sys.stdin.readline())
    took = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        c.register(pb.RegisterRequest(tenant=tenants[(len(took) + 1) % len(tenants)], keep=True))
        took.append(time.perf_counter() - t0)
print(json.dumps({"registrations": len(took), "seconds": seconds,
                  "p50_ms": 1000 * statistics.median(took), "max_ms": 1000 * max(took)}), flush=True)
"""


def round_trips(sock: str, seconds: float) -> list[float]:
    """`Status` round trips, back to back, for `seconds`."""
    from unisched.transport.client import DaemonClient

    out: list[float] = []
    with DaemonClient(sock, timeout=30) as c:
        c.status()  # the channel's connection is not timed
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            c.status()
            out.append(time.perf_counter() - t0)
    return out


def stats_ms(xs: list[float]) -> dict[str, float]:
    return {"round_trips": len(xs), "p50": 1000 * statistics.median(xs), "p99": 1000 * percentile(xs, 0.99),
            "max": 1000 * max(xs)}


def readline(proc: subprocess.Popen[str], what: str) -> str:
    """The registrar's next line, or exit with what it wrote on stderr when it ended instead."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(REPLY_S)
        err = proc.stderr.read() if proc.stderr else ""
        raise SystemExit(f"registration_load: the registrar ended before {what}:\n{err[-2000:]}")
    return line


def measure(sock: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    quiet = round_trips(sock, args.warmup)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "clients")])}
    reg = subprocess.Popen([sys.executable, "-c", REGISTRAR, sock, ",".join(TENANTS)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        readline(reg, "it registered the first time")
        assert reg.stdin is not None
        reg.stdin.write(f"{args.seconds}\n")
        reg.stdin.flush()
        busy = round_trips(sock, args.seconds)
        done = json.loads(readline(reg, "it reported"))
        reg.wait(REPLY_S)
    finally:
        if reg.poll() is None:
            reg.kill()
            reg.wait()
    return {"registrar": done, "quiet_ms": stats_ms(quiet), "registering_ms": stats_ms(busy)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the registrar registers (default 10)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of Status round trips alone first (default 3)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout the daemon runs from (default this one)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.seconds < 1 or args.warmup <= 0:
        ap.error("--seconds must be >= 1 and --warmup positive")
    if os.geteuid() != 0:
        raise SystemExit("registration_load: needs root (each registration moves the registrar between cgroups)")
    root = args.root.resolve()
    subtree = f"unisched-bench-registration-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="registration-load-"))
    print(f"registration_load: {args.warmup:g} s alone, then {args.seconds:g} s of registrations", file=sys.stderr)
    daemon, sock = start_daemon(work, "--no-nvml", "--cgroup-subtree", subtree, root=root)
    try:
        res = measure(sock, root, args)
    finally:
        daemon.terminate()
        daemon.wait(30)
        remove_subtree(subtree)
    late = (work / "daemon.log").read_text(errors="replace").count(LATE_WARNING)
    res = {**run_info(), "root": str(root), **res, "late_warnings": late}
    q, b, r = res["quiet_ms"], res["registering_ms"], res["registrar"]
    md = (header(res) + f"One process registered {r['registrations']} times in {r['seconds']:g} s "
          f"({r['registrations'] / r['seconds']:.0f} a second; a registration took {r['p50_ms']:.2f} ms at the median, "
          f"{r['max_ms']:.2f} ms at most), alternating between two tenants, so that each moved it. The daemon warned "
          f"{late} times that its slice loop ran late.\n\n"
          "| Status round trips | count | p50 | p99 | max |\n|---|---|---|---|---|\n"
          + "".join(f"| {name} | {s['round_trips']} | {s['p50']:.2f} ms | {s['p99']:.2f} ms | {s['max']:.2f} ms |\n"
                    for name, s in (("alone", q), ("during the registrations", b))))
    write(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
