#!/usr/bin/env python3
"""The floor under a lease renewal's round trip on this machine: two bare Python processes on a Unix socket.

A child process echoes what it reads (a blocking socket, nothing else); this process sends a lease renewal's bytes
(a framed report with a seq, ~20 bytes) every --every-ms and times until the echo is back, as bench/lease_load.py
times a renewal's ack. No daemon, no asyncio, no protobuf: what is left is the kernel's socket path and waking two
idle processes. A renewal through the daemon cannot be faster than this, so beside it the report shows how much of a
round trip is the daemon's and how much the machine's.

  python3 bench/echo_floor.py --seconds 15 --warmup 3 --every-ms 25 --out DIR
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import header, run_info, write
from lease_load import percentile  # the same percentiles as the round trips it is set beside

MESSAGE = b"\x00\x00\x00\x10" + bytes(range(16))
"""A lease renewal's size on the wire: a 4-byte length, then a report of that length."""


def echo(conn: socket.socket, other: socket.socket) -> None:
    """The child: every byte read goes back, until the other end closes (the fork's copy of that end closed first,
    or the child would hold it open and never read its end)."""
    other.close()
    while data := conn.recv(4096):
        conn.sendall(data)


def measure(every_s: float, seconds: float, warmup: float) -> list[float]:
    """Round trips (s) after `warmup`, one message every `every_s` (paced on the clock, not on the echo)."""
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child = mp.get_context("fork").Process(target=echo, args=(there, here), daemon=True)
    child.start()
    there.close()
    rtts: list[float] = []
    try:
        t0 = time.perf_counter()
        next_at = t0
        while (now := time.perf_counter()) < t0 + warmup + seconds:
            time.sleep(max(0.0, next_at - now))  # pacing the sends, as a client renews on its clock
            next_at += every_s
            start = time.perf_counter()
            here.sendall(MESSAGE)
            got = 0
            while got < len(MESSAGE):
                got += len(here.recv(4096))
            if start >= t0 + warmup:
                rtts.append(time.perf_counter() - start)
    finally:
        here.close()
        child.join(10)
        if child.is_alive():
            child.kill()
    return rtts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window (default 15)")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured start (default 3)")
    ap.add_argument("--every-ms", type=float, default=25.0, help="one message every this long (default 25)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.seconds <= 0 or args.warmup < 0 or args.every_ms <= 0:
        ap.error("--seconds and --every-ms must be positive, --warmup not negative")
    rtts = measure(args.every_ms / 1000.0, args.seconds, args.warmup)
    res = {**run_info(), "every_ms": args.every_ms,
           "round_trips": len(rtts),
           "rtt_ms": {"p50": 1000 * percentile(rtts, 0.5), "p99": 1000 * percentile(rtts, 0.99),
                      "max": 1000 * max(rtts, default=float("nan")),
                      "mean": 1000 * statistics.fmean(rtts) if rtts else float("nan")}}
    r = res["rtt_ms"]
    md = (header(res) + "| what | every | round trips | p50 | p99 | max |\n|---|---|---|---|---|---|\n"
          f"| bare echo on a Unix socket | {args.every_ms:g} ms | {len(rtts)} | {r['p50']:.3f} ms | {r['p99']:.3f} ms | "
          f"{r['max']:.3f} ms |\n")
    write(args.out, res, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
