#!/usr/bin/env python3
"""The engine alone at scale (no gRPC, fake cgroups, injected clock): N cooperative tenants open a lease session
and want compute, each renews once, then ticks run; wall time of each phase on this machine.

  python3 bench/engine_scale.py --tenants 1000 --out bench/results/DATE-HOST/engine-scale
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.leases import FakeLeaseChannel
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import NoGpuTelemetry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--ticks", type=int, default=50)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    clock = FakeClock()
    state = Path(tempfile.mkdtemp(prefix="engine-scale-"))
    engine = Scheduler(DaemonConfig(state_dir=str(state)), FakeCgroupDriver(), NoGpuTelemetry(),
                          StateStore(state), clock)
    engine.start()
    t0 = time.perf_counter()
    sids = []
    for i in range(args.tenants):
        sid, _ = engine.lease_open(f"t{i}", 100, None, ["compute"], 0, 10_000 + i, 0, True, FakeLeaseChannel())
        engine.lease_want(sid, "compute")
        sids.append(sid)
    register_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for sid in sids:
        engine.lease_report(sid, "compute", 0.0, False)
    renew_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.ticks):
        clock.advance(engine.tick())
    tick_s = (time.perf_counter() - t0) / args.ticks
    res = {"command": "python3 bench/engine_scale.py " + shlex.join(sys.argv[1:]),
           "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
           "tenants": args.tenants, "open_and_want_total_s": register_s, "renewal_us": 1e6 * renew_s / args.tenants,
           "tick_ms": 1000 * tick_s}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    md = (f"Command: `{res['command']}` | {res['date_utc']} UTC | host {res['host']}\n\n"
          "| tenants | open + want, all | one renewal | one tick |\n|---|---|---|---|\n"
          f"| {args.tenants} | {register_s:.2f} s | {res['renewal_us']:.1f} us | {res['tick_ms']:.2f} ms |\n")
    (args.out / "results.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
