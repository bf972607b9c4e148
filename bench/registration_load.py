#!/usr/bin/env python3
"""Registration load: while registrations come in bursts, how long do other callers wait?

Each `Register` moves the caller's process into its tenant's cgroup: a write to cgroup.procs, which can wait for the
kernel (an RCU grace period: milliseconds for a move that comes alone, little for one right after another). Any
local user may register, so the daemon must not make everyone else wait while it moves someone, nor let one user's
pile of registrations hold back another user's. Two phases, each --seconds long, after --warmup seconds of
`Status` round trips alone:

  spaced         a registrar process registers every --gap-ms (as separate `unisched run`s do), alternating
                 between two tenants so that every registration is a real move, while this process times `Status`
                 round trips to the same daemon
  beside a burst a registrar (root) registers back to back while --burst-procs processes of another user (nobody,
                 uid 65534) each ask for --burst-calls registrations at once on one connection, a batch at a time
                 (as many as the daemon lets the connection have in flight run, the client queues the rest); the
                 registrar's own registrations are timed

The report gives the round trips alone and during the registrations, each phase's registrations and how long the
registrar's took, and how often the daemon warned that its slice loop ran late. With --root DIR the daemon and the
registrars run from another checkout (to compare with an older commit). CPU only: the daemon runs with --no-nvml,
and with --activity-threshold 1 so that it does not time-slice the registering processes (their tenants' CPU
time would otherwise count as work, and a registrar moved into a frozen tenant would wait for its turn: this
measures the registrations, not the slicing). Needs root, since the moves are real and the burst runs as another
user.

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
from _daemon import ROOT, bench_env, start_daemon, stop_daemon
from _results import header, run_info, write
from lease_load import percentile

sys.path[:0] = [str(ROOT), str(ROOT / "clients")]

TENANTS = ("reg-a", "reg-b")
"""The registrar alternates between these, so that each registration moves it."""
BURST_TENANTS = ("burst-a", "burst-b")
"""The burst's processes alternate between these."""
BURST_UID = 65534
"""The burst's user (nobody): another uid than the registrar's."""
LATE_WARNING = "slice loop ran late"
"""What the daemon logs when its event loop started a slice late."""
REPLY_S = 120.0
"""The registrar must answer within this long, or the run gives up."""

REGISTRAR = r"""
import json, statistics, sys, time
from unisched.transport.client import DaemonClient
from unisched_wire import unisched_pb2 as pb
sock, tenants, gap = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
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
        time.sleep(gap)  # the workload's own pace
took.sort()
print(json.dumps({"registrations": len(took), "seconds": seconds, "gap_ms": 1000 * gap, "p50_ms": 1000 * statistics.median(took),
                  "p99_ms": 1000 * took[min(len(took) - 1, int(0.99 * len(took)))], "max_ms": 1000 * took[-1]}),
      flush=True)
"""

BURST = r"""
import json, os, sys, time
import grpc
from unisched_wire import unisched_pb2 as pb, unisched_pb2_grpc as pb_grpc
sock, tenants, calls, uid = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
channel = grpc.insecure_channel(f"unix:{sock}")
stub = pb_grpc.UnischedStub(channel)
os.setuid(uid)  # the channel connects at its first call: as this user
stub.Register(pb.RegisterRequest(tenant=tenants[0], keep=True), timeout=60)
print("ready", flush=True)
seconds = float(sys.stdin.readline())
n, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    batch = [stub.Register.future(pb.RegisterRequest(tenant=tenants[i % len(tenants)], keep=True), timeout=60)
             for i in range(calls)]
    n += sum(1 for f in batch if f.exception() is None)
print(json.dumps({"registrations": n}), flush=True)
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


def start(script: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A registrar or burst process, once it said it is ready (imported, connected, registered once)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    readline(proc, "it registered the first time")
    return proc


def go(procs: list[subprocess.Popen[str]], seconds: float) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{seconds}\n")
        proc.stdin.flush()


def report(proc: subprocess.Popen[str]) -> dict[str, Any]:
    done: dict[str, Any] = json.loads(readline(proc, "it reported"))
    proc.wait(REPLY_S)
    return done


def measure(sock: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    quiet = round_trips(sock, args.warmup)
    env = bench_env(root)
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(reg := start(REGISTRAR, [sock, ",".join(TENANTS), str(args.gap_ms / 1000)], env))
        go([reg], args.seconds)
        busy = round_trips(sock, args.seconds)
        spaced = report(reg)
        procs.append(reg := start(REGISTRAR, [sock, ",".join(TENANTS), "0"], env))
        burst = [start(BURST, [sock, ",".join(BURST_TENANTS), str(args.burst_calls), str(BURST_UID)], env)
                 for _ in range(args.burst_procs)]
        procs += burst
        go(burst, args.seconds + 1.0)  # under way before the registrar starts, and until after it ends
        go([reg], args.seconds)
        beside = report(reg)
        burst_done = sum(report(p)["registrations"] for p in burst)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"registrar": spaced, "quiet_ms": stats_ms(quiet), "registering_ms": stats_ms(busy),
            "beside_burst": {"registrar": beside, "procs": args.burst_procs, "calls": args.burst_calls,
                             "burst_registrations": burst_done}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the registrar registers (default 10)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of Status round trips alone first (default 3)")
    ap.add_argument("--gap-ms", type=float, default=20.0,
                    help="the spaced registrar's pause between registrations (default 20 ms)")
    ap.add_argument("--burst-procs", type=int, default=16, help="processes of the burst's user (default 16)")
    ap.add_argument("--burst-calls", type=int, default=100,
                    help="registrations each asks for at once (default 100: h2's default streams on a connection)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout the daemon runs from (default this one)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.seconds < 1 or args.warmup <= 0 or args.gap_ms < 0 or args.burst_procs < 1 or args.burst_calls < 1:
        ap.error("--seconds must be >= 1, --warmup positive, --gap-ms >= 0, --burst-procs and --burst-calls >= 1")
    if os.geteuid() != 0:
        raise SystemExit("registration_load: needs root (each registration moves the registrar between cgroups)")
    root = args.root.resolve()
    work = Path(tempfile.mkdtemp(prefix="registration-load-"))
    work.chmod(0o755)  # the burst's user reaches the socket in it
    print(f"registration_load: {args.warmup:g} s alone, {args.seconds:g} s of registrations every {args.gap_ms:g} ms, then "
          f"{args.seconds:g} s beside {args.burst_procs} x {args.burst_calls} of uid {BURST_UID}", file=sys.stderr)
    daemon, sock = start_daemon(work, "--no-nvml", "--activity-threshold", "1", root=root)
    try:
        res = measure(sock, root, args)
    finally:
        stop_daemon(daemon, work)
    late = (work / "daemon.log").read_text(errors="replace").count(LATE_WARNING)
    res = {**run_info(), "root": str(root), **res, "late_warnings": late}
    q, b, r = res["quiet_ms"], res["registering_ms"], res["registrar"]
    bb = res["beside_burst"]
    md = (header(res) + f"Spaced: one process registered {r['registrations']} times in {r['seconds']:g} s, pausing "
          f"{r['gap_ms']:g} ms after each (a registration took {r['p50_ms']:.2f} ms at the median, {r['max_ms']:.2f} ms "
          f"at most), alternating between two tenants, so that each moved it. The daemon warned {late} times that its "
          "slice loop ran late.\n\n"
          "| Status round trips | count | p50 | p99 | max |\n|---|---|---|---|---|\n"
          + "".join(f"| {name} | {s['round_trips']} | {s['p50']:.2f} ms | {s['p99']:.2f} ms | {s['max']:.2f} ms |\n"
                    for name, s in (("alone", q), ("during the registrations", b)))
          + f"\nBeside a burst: {bb['procs']} processes of uid {BURST_UID}, each asking for {bb['calls']} registrations "
          f"at once, made {bb['burst_registrations']} registrations; meanwhile the registrar (uid 0) made "
          f"{bb['registrar']['registrations']}.\n\n"
          "| the registrar's registrations | count | p50 | p99 | max |\n|---|---|---|---|---|\n"
          + "".join(f"| {name} | {x['registrations']} | {x['p50_ms']:.2f} ms | {x['p99_ms']:.2f} ms | "
                    f"{x['max_ms']:.2f} ms |\n"
                    for name, x in (("spaced", r), ("back to back, beside the burst", bb["registrar"]))))
    write(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
