#!/usr/bin/env python3
"""What one event costs the daemon as its tenants grow: the per-call work a local user can drive as fast as it is
answered, timed in-process on the engine over fakes (no GPU, no root, no daemon), for each --tenants count:

  session decision   a hooked app's new decode session at its default cap, refused (the event loop decides it, and
                     an app retrying a refused session asks again at once)
  memory charge      one video memory allocation charged to the ledger the hooks keep (their thread; a CUDA context
                     makes about 71), a third of the tenants holding memory and one with a cap and a reserve
  caller's tenant    which tenant holds a caller (every Status call and seccomp hand-over asks), for a caller in none

Every tenant is registered busy on one GPU of 80 GiB with 7 NVDEC engines and the engine ticks a few slices first,
so they all have work there. Each figure is the median over --repeat timings of --calls calls (us a call). Which code
is timed is whatever `unisched` imports (PYTHONPATH), so the same script times another checkout:

  python3 bench/tenant_scale.py --out bench/results/DATE-cpu-COMMIT-tenant-scale/now
  PYTHONPATH=/tmp/old-checkout python3 bench/tenant_scale.py --out .../before
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import header, run_info, write

import unisched
from unisched.enforce.cgroups import FakeCgroupDriver
from unisched.enforce.seccomp.ledger import MemoryLedger
from unisched.scheduler.clock import FakeClock
from unisched.scheduler.config import DaemonConfig
from unisched.scheduler.core import Scheduler
from unisched.scheduler.state import StateStore
from unisched.telemetry import FakeTelemetry, GpuInfo

GIB = 1 << 30
SLICE_S = 0.05
CASES = ("session decision", "memory charge", "caller's tenant")


def engine_with(n: int, work: Path) -> tuple[Scheduler, FakeCgroupDriver]:
    driver, clock = FakeCgroupDriver(), FakeClock()
    tel = FakeTelemetry([GpuInfo(0, "NVIDIA H200", "GPU-0", 80 * GIB)])
    engine = Scheduler(DaemonConfig(slice_ms=SLICE_S * 1000), driver, tel, StateStore(work / "state"), clock)
    engine.start()
    for i in range(n):
        engine.register(f"t{i}", 100, None, (), (), 1000 + i, 0, True)
    for _ in range(3):  # a few slices in which every tenant burns CPU: each has work on the GPU
        for i in range(n):
            driver.groups[f"/unisched/t{i}"].cpu_s += SLICE_S
        clock.advance(engine.tick())
    return engine, driver


def per_call_us(fn: Callable[[], object], calls: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(n: int, calls: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tenant-scale-") as tmp:
        engine, driver = engine_with(n, Path(tmp))
        while engine.admit_session("t0", "nvdec", 0xB8B0):  # up to its default cap
            pass
        engine.set_limits("t1", None, None, None, 4 * GIB, GIB)
        ledger = MemoryLedger(engine.memory_terms, engine.gpu_memory_totals)
        for i in range(0, n, 3):
            ledger.charge(f"t{i}", 0, 1 << 20)
        driver.pid_cgroup[99999] = "/elsewhere/app"
        return {
            "session decision": per_call_us(lambda: engine.admit_session("t0", "nvdec", 0xB8B0), calls, repeat),
            "memory charge": per_call_us(lambda: ledger.charge("t2", 0, 4096), calls, repeat),
            "caller's tenant": per_call_us(lambda: engine.tenant_of_pid(99999), calls, repeat),
        }


def table(res: dict[str, Any]) -> str:
    counts = list(res["us_a_call"])
    lines = [header(res), f"Code timed: `unisched` at {res['commit']} ({res['unisched']}). Median of {res['repeat']} timings of "
             f"{res['calls']} calls, us a call.", "",
             "| tenants | " + " | ".join(CASES) + " |", "|---|" + "---|" * len(CASES)]
    for n in counts:
        cells = " | ".join(f"{res['us_a_call'][n][c]:.1f}" for c in CASES)
        lines.append(f"| {n} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tenants", default="10,100,1000,5000", help="tenant counts, comma-separated (default 10,100,1000,5000)")
    ap.add_argument("--calls", type=int, default=200, help="calls a timing (default 200)")
    ap.add_argument("--repeat", type=int, default=5, help="timings a case (default 5)")
    args = ap.parse_args()
    try:
        counts = [int(x) for x in args.tenants.split(",") if x]
    except ValueError:
        ap.error("--tenants takes whole numbers, comma-separated")
    if not counts or min(counts) < 3 or args.calls < 1 or args.repeat < 1:
        ap.error("--tenants of 3 or more each, --calls and --repeat of 1 or more")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    where = Path(unisched.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    res: dict[str, Any] = {**run_info(), "unisched": str(where), "commit": commit.stdout.strip() or "unknown",
                           "calls": args.calls, "repeat": args.repeat, "us_a_call": {}}
    for n in counts:
        print(f"tenant_scale: {n} tenants", file=sys.stderr)
        res["us_a_call"][n] = measure(n, args.calls, args.repeat)
        write(args.out, res, table(res))  # what was measured so far survives a run cut short
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
