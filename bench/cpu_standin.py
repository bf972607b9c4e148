#!/usr/bin/env python3
"""CPU stand-in for the GPU workloads, to exercise bench/gpu_pairs.py where there is no GPU.

Why: the orchestration (launching tenants together, aligned windows, reports, scoring, tables) should
be checkable on a laptop or CI box. This burns CPU in small fixed chunks and writes exactly the
report the real workloads write. Pinning two stand-ins to one CPU (`--pin-cpu 0`) makes them contend
like CUDA + CUDA; pinning them to different CPUs makes them overlap like CUDA + render on the H200.

Example: gpu_pairs.py --workload-cmd-cuda "python3 bench/cpu_standin.py --kind cuda --pin-cpu 0" \
                      --workload-cmd-render "python3 bench/cpu_standin.py --kind render --pin-cpu 0" ...

With --client TENANT it stands in for a cooperative client (cuda_matmul.py / egl_render.py --client): each item
waits for the lease of its kind's engine and is charged the CPU time it took, as a GPU client is charged its
steps' GPU time (with `unisched serve --cpu-stand-in` CPU 0 is GPU 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "workloads"))
from _window import StepPauser, add_window_args, measure, plan_window, write_report

UNITS = {"cuda": "matmul/s", "render": "frames/s"}
ENGINES = {"cuda": "compute", "render": "graphics"}


def gated(item: Callable[[], int], tenant: str, weight: int, socket: str | None, engine: str,
          clock: Callable[[], float]) -> tuple[Callable[[], int], Any]:
    """Each item inside the engine's lease (the client library's Gate), reported as its `clock` time used."""
    from unisched_client import Client  # lazy: only a stand-in client needs clients/ on the path

    client = Client(tenant, weight, socket=socket, engines=(engine,))
    gate = client.gate(engine)

    def step() -> int:
        gate.acquire()
        t0 = clock()
        n = item()
        gate.done(clock() - t0)
        return n

    return step, client


def burn(chunk: int) -> int:
    """One item of work: `chunk` rounds of integer arithmetic (about a millisecond by default)."""
    acc = 0
    for i in range(chunk):
        acc = (acc * 31 + i) & 0xFFFF
    return 1 if acc >= 0 else 0


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    parser = argparse.ArgumentParser(description="CPU stand-in for cuda_matmul.py / egl_render.py "
                                                 "(same arguments and JSON report).")
    add_window_args(parser)
    parser.add_argument("--kind", choices=sorted(UNITS), default="cuda",
                        help="which workload this stands in for (sets kind and unit in the report)")
    parser.add_argument("--pin-cpu", type=int, default=None, metavar="CPU",
                        help="run on this CPU only, so stand-ins pinned alike contend")
    parser.add_argument("--chunk", type=int, default=20000, help="loop rounds per item")
    parser.add_argument("--start-up-s", type=float, default=0.0, metavar="S",
                        help="idle this long before the first item, as a slow start-up (torch import, CUDA init) "
                             "would: a start-up longer than the warm-up makes the window start late")
    parser.add_argument("--item-ms", type=float, default=None, metavar="MS",
                        help="idle this long per item instead of burning CPU: a rate the host's load hardly moves, "
                             "for tests of the orchestration's arithmetic on a busy machine")
    parser.add_argument("--pausable", action="store_true",
                        help="idle between items from SIGUSR1 to SIGUSR2, as examples/02 --pausable")
    parser.add_argument("--client", metavar="TENANT", default=None,
                        help="stand in for a cooperative client under this tenant name: each item inside the lease "
                             "of the kind's engine, charged its CPU time")
    parser.add_argument("--weight", type=int, default=100, help="with --client: the tenant's weight (default: 100)")
    parser.add_argument("--socket", default=None, help="with --client: the daemon's socket (default: the client's)")
    # Accepted and ignored so the orchestrator can pass the real workloads' options unchanged.
    parser.add_argument("--iterations", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sync-every", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})
    start_at, end_at = plan_window(args, process_start)
    time.sleep(max(0.0, args.start_up_s))  # the start-up being stood in for, not a wait for a condition
    pauser = StepPauser() if args.pausable else None

    def item() -> int:
        if pauser is not None:
            pauser.between_steps()
        if args.item_ms is not None:
            time.sleep(args.item_ms / 1000.0)  # the item's duration, not a wait for a condition
            return 1
        return burn(args.chunk)

    client = None
    step: Callable[[], int] = item
    if args.client is not None:  # CPU time a burnt item used; wall time an idled one (--item-ms) took
        clock = time.perf_counter if args.item_ms is not None else time.thread_time
        step, client = gated(item, args.client, args.weight, args.socket, ENGINES[args.kind], clock)
    window = measure(step, start_at, end_at)
    if client is not None:
        client.close()
    report = write_report(args.report, args.kind, UNITS[args.kind], window,
                          {"standin": True, "pin_cpu": args.pin_cpu, "chunk": args.chunk,
                           **({"pauses": pauser.pauses} if pauser else {}),
                           **({"client": args.client, "weight": args.weight} if client is not None else {})})
    print(f"cpu_standin[{args.kind}] pid={report['pid']}: {window.throughput:.1f} {UNITS[args.kind]} "
          f"({window.items} items in {window.seconds:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
