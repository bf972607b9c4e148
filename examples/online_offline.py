#!/usr/bin/env python3
"""Online inference with Poisson arrivals: the latency-sensitive half of the online + offline scenario.

Requests arrive at --rate per second (exponential gaps, seeded, so every setup sees the same arrivals); one
server answers them in order, each a ResNet-50 forward pass (fp16, batch --batch, random weights, nothing
downloaded). A request's latency runs from its ARRIVAL to its result on the host, so queueing behind a slow
answer counts, as it does for a user. The offline half is examples/02_pytorch_training.py; --trainer starts
it beside this one so the pair can be run by hand:

  python3 examples/online_offline.py --seconds 20                                # online alone
  python3 examples/online_offline.py --seconds 20 --trainer                      # + training, no scheduler
  unisched serve --mode preemptive &                                             # then, freezer enforcement:
  unisched run --tenant train --priority offline -- python3 examples/02_pytorch_training.py --seconds 30 &
  unisched run --tenant infer --priority online -- python3 examples/online_offline.py --seconds 20
  python3 examples/online_offline.py --tenant infer --priority online --seconds 20   # lease enforcement (leases)
  unisched serve --mode preemptive --mps &      # either engine, the trainer an MPS client below normal on 70% of SMs

bench/scenarios.py runs every setup (alone, no scheduler, MPS, both engines) and scores them.
Report (--report): the shared workload fields (throughput = answered requests/s) plus latency_ms
{p50, p90, p99, p99_lo, p99_hi (the p99's 90% distribution-free interval), n, mean, max}, latencies_ms and arrivals_s
(every answered request's latency and arrival, seconds into the window, in arrival order: a benchmark keeps the
requests that met its partner and pools rounds), requests, dropped (arrivals never answered inside the window).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _coop import add_unisched_args, connect, share_line, share_report
from _window import Window, add_window_args, fail, latency_summary, plan_window, write_report

HERE = Path(__file__).resolve().parent
WARMUP_ANSWERS = 20


def arrivals(rate: float, start: float, end: float, seed: int) -> list[float]:
    """Poisson arrival times in [start, end): the same list for every setup with the same seed."""
    rng = random.Random(seed)
    out: list[float] = []
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return out
        out.append(t)


def build(batch: int, model: str) -> Any:
    import torch
    import torchvision

    net = getattr(torchvision.models, model)(weights=None).cuda().half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda").half().to(memory_format=torch.channels_last)

    def infer() -> None:
        with torch.inference_mode():
            net(x)

    return infer


def trainer_argv(args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(HERE / "02_pytorch_training.py"), "--model", "resnet50",
            "--seconds", str(args.seconds + args.warmup + 5), "--warmup", "0"]


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--rate", type=float, default=20.0, help="mean requests per second (default 20)")
    ap.add_argument("--batch", type=int, default=1, help="images per request (default 1; 8 for a heavier load)")
    ap.add_argument("--model", default="resnet50", help="torchvision classification model (default resnet50)")
    ap.add_argument("--seed", type=int, default=1, help="arrival-time seed (default 1)")
    ap.add_argument("--trainer", action="store_true",
                    help="also start examples/02_pytorch_training.py (ResNet-50 training, batch 32) beside it, "
                         "with no scheduler, for the whole run")
    add_unisched_args(ap)
    args = ap.parse_args(argv)
    if args.rate <= 0 or args.batch < 1:
        ap.error("--rate must be positive and --batch at least 1")
    start_at, end_at = plan_window(args, start)
    try:
        import torch
    except ImportError as e:
        return fail(f"PyTorch is not importable: {e}")
    client = connect(args, ("compute",))  # before CUDA starts: the daemon's MPS settings, where it has them
    if not torch.cuda.is_available():
        return fail("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    trainer = subprocess.Popen(trainer_argv(args)) if args.trainer else None
    try:
        infer = build(args.batch, args.model)
    except (AttributeError, TypeError) as e:
        return fail(f"--model {args.model}: not a torchvision classification model ({e})")
    step_gate = client.step() if client is not None else None
    waits: list[float] = []
    """Per answer, the seconds from asking for the lease to holding it: the part of a latency spent on unisched's
    round trip (and, in preemptive mode, nothing more: an online request is granted beside the holder)."""

    def answer() -> None:
        if step_gate is not None:
            asked = time.perf_counter()
            with step_gate:
                waits.append(time.perf_counter() - asked)
                infer()
            step_gate.drain()
        else:
            infer()
            torch.cuda.synchronize()

    for _ in range(WARMUP_ANSWERS):  # cuDNN autotuning, lazy module loading: never inside the window
        answer()
    while time.time() < start_at - 0.2:
        answer()
    # a start-up that overran the window's start must not count as queueing: requests begin once we are ready
    late_s = max(0.0, time.time() - start_at)
    times = arrivals(args.rate, start_at + late_s, end_at, args.seed)
    gate = client.gate("compute") if client is not None else None
    waits.clear()  # the warm-up's answers are not the window's
    latencies: list[float] = []
    timeline: list[tuple[float, int]] = []
    for i, arrival in enumerate(times):
        now = time.time()
        if now < arrival:
            time.sleep(arrival - now)  # pacing the workload itself, not waiting on a test condition
        answer()
        if gate is not None and (i + 1 == len(times) or times[i + 1] > time.time()):
            gate.release()  # nothing queued: hand the GPU back to the offline tenant until the next request
        done = time.time()
        if done > end_at:
            break
        latencies.append(done - arrival)
        timeline.append((round(done - start_at, 3), len(latencies)))
    dropped = len(times) - len(latencies)
    window = Window(items=len(latencies), seconds=end_at - start_at, t_first=start_at,
                    t_last=start_at + (timeline[-1][0] if timeline else 0.0), start_at=start_at, end_at=end_at,
                    late_s=late_s, warmup_items=WARMUP_ANSWERS, timeline=tuple(timeline))
    share = share_report(client, "compute")
    lat = latency_summary([1000.0 * v for v in latencies])
    report = write_report(args.report, "online", "req/s", window,
                          {"requests": len(times), "dropped": dropped, "rate": args.rate, "batch": args.batch,
                           "model": args.model, "latency_ms": lat, "share": share,
                           "latencies_ms": [round(1000.0 * v, 3) for v in latencies],
                           "lease_wait_ms": latency_summary([1000.0 * v for v in waits]) if waits else None,
                           "arrivals_s": [round(a - start_at, 3) for a in times[:len(latencies)]]})
    print(f"online_offline pid={report['pid']}: {args.model} fp16 batch {args.batch} at {args.rate:g} req/s: "
          f"p50 {lat.get('p50', float('nan')):.2f} ms, p99 {lat.get('p99', float('nan')):.2f} ms, "
          f"{len(latencies)}/{len(times)} answered; {share_line(share)}", flush=True)
    if trainer is not None:
        trainer.terminate()
        trainer.wait(timeout=30)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
