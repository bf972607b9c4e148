#!/usr/bin/env python3
"""gRPC call and lease round-trip latency of two checkouts of the daemon, interleaved on one machine.

For each round and each checkout (alternating, so both see the same background load): a bare daemon of that
checkout (`unisched serve --no-nvml`, bench/_daemon.py) on a private socket, then
  - unary calls: --calls Status calls, one after another, from the CLI's grpcio client (DaemonClient) on one
    channel, after --warm unmeasured ones; each call's wall time;
  - lease round trips: one cooperative tenant (bench/lease_load.py's protocol tenant: hello, want, then a renewal
    report with a seq every --renew-ms) for --lease-seconds after 1 s of warm-up; each report's send-to-ack time,
    on the daemon's lease socket (or its main socket for a checkout that serves leases there).
p50 and p99 of each, per round and checkout, and the median over rounds, to --out (results.json, README.md body).

  python3 bench/grpc_unix.py --before /tmp/before --rounds 3 --out bench/results/DATE-grpc-unix
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))
from _daemon import ROOT, start_daemon
from lease_load import _tenant, lease_socket_of, percentile

sys.path.insert(0, str(ROOT))
from unisched.transport.client import DaemonClient


def _ms(xs: list[float], q: float) -> float:
    return round(percentile(xs, q) * 1000, 3)


def unary_calls(sock: str, n: int, warm: int) -> list[float]:
    out = []
    with DaemonClient(sock, timeout=30) as c:
        for i in range(warm + n):
            t = time.perf_counter()
            c.status()
            if i >= warm:
                out.append(time.perf_counter() - t)
    return out


def lease_rtts(sock: str, seconds: float, renew_s: float) -> tuple[list[float], list[dict[str, Any]]]:
    rtts: list[float] = []
    lost: list[dict[str, Any]] = []
    counts = {"sent": 0, "grants": 0, "revokes": 0}
    t0 = time.perf_counter()
    asyncio.run(_tenant(lease_socket_of(sock), "bench", renew_s, t0 + 1.0 + seconds, t0 + 1.0, rtts, counts, lost, t0))
    return rtts, lost


def one(label: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"grpc-unix-{label}-"))
    daemon, sock = start_daemon(work, "--no-nvml", "--log-level", "warning", "--cgroup-subtree",
                                f"unisched-bench-{os.getpid()}", root=root)
    try:
        calls = unary_calls(sock, args.calls, args.warm)
        rtts, lost = lease_rtts(sock, args.lease_seconds, args.renew_ms / 1000.0)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    return {"checkout": label, "status_n": len(calls), "status_p50_ms": _ms(calls, 0.5), "status_p99_ms": _ms(calls, 0.99),
            "lease_n": len(rtts), "lease_p50_ms": _ms(rtts, 0.5), "lease_p99_ms": _ms(rtts, 0.99), "lease_lost": lost}


def commit_of(root: Path) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--after", type=Path, default=ROOT, help="default: this checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--lease-seconds", type=float, default=10.0)
    ap.add_argument("--renew-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = []
    for r in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        for label, root in order if r % 2 == 0 else order[::-1]:
            res = {"round": r + 1, **one(label, root, args)}
            print(json.dumps({k: v for k, v in res.items() if k != "lease_lost"}), file=sys.stderr)
            runs.append(res)
    medians = {label: {k: statistics.median(x[k] for x in runs if x["checkout"] == label)
                       for k in ("status_p50_ms", "status_p99_ms", "lease_p50_ms", "lease_p99_ms")}
               for label in ("before", "after")}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    res = {"command": "python3 bench/grpc_unix.py " + " ".join(sys.argv[1:]),
           "date": dt.datetime.now().isoformat(timespec="seconds"), "nproc": os.cpu_count(), "cpu": cpu,
           "commits": {"before": commit_of(args.before), "after": commit_of(args.after)}, "runs": runs, "medians": medians}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(medians, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
