#!/usr/bin/env python3
"""Saturating CUDA compute tenant: back-to-back bf16 matmuls, synchronising every few.

Why it looks like this: it is the "CUDA" side of the sharing benchmark (bench/gpu_pairs.py). Large
bf16 matmuls keep every SM busy, and synchronising every `--sync-every` matmuls keeps the work
queued on the GPU short (a few ms), so a tenant frozen by the scheduler stops using the GPU almost
at once (on the H200 a process that queues 200 matmuls keeps the GPU busy ~0.9 s after a freeze).

Output: one human line on stdout, and with --report a JSON file
  {"kind": "cuda", "throughput": matmuls/s, "unit": "matmul/s", "items": n, "seconds": window, "pid": ...}
counting only matmuls completed inside the measured window (see _window.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _window import add_window_args, fail, measure, plan_window, write_report

KIND = "cuda"
UNIT = "matmul/s"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Saturating CUDA load for GPU-sharing benchmarks: bf16 SIZExSIZE matmuls "
                    "(torch), synchronising every --sync-every matmuls. Measures matmuls/s over "
                    "a window that starts after --warmup (or at --start-at).",
        epilog="Example: cuda_matmul.py --seconds 20 --warmup 5 --report /tmp/cuda.json",
    )
    add_window_args(parser)
    parser.add_argument("--size", type=int, default=8192,
                        help="matrix side N (NxN @ NxN, bf16); default 8192 (~1.1 TFLOP per matmul)")
    parser.add_argument("--sync-every", type=int, default=4,
                        help="torch.cuda.synchronize() after this many matmuls; bounds the queued "
                             "work a frozen tenant leaves behind (default: 4)")
    parser.add_argument("--device", default="cuda:0", help="torch device (default: cuda:0)")
    parser.add_argument("--client", metavar="TENANT", default=None,
                        help="run as a cooperative client of unisched under this tenant name: each step of "
                             "--sync-every matmuls is gated by `client.step()` (leases) instead of being "
                             "synchronised, as an app using the client library would")
    parser.add_argument("--weight", type=int, default=100, help="with --client: the tenant's weight (default: 100)")
    parser.add_argument("--socket", default=None, help="with --client: the daemon's socket (default: the client's)")
    args = parser.parse_args(argv)
    if args.size <= 0 or args.sync_every <= 0 or args.seconds <= 0:
        parser.error("--size, --sync-every and --seconds must be positive")
    return args


def make_step(size: int, sync_every: int, device: str) -> tuple[Callable[[], int], dict[str, Any]]:
    """Allocate the operands and return a step that runs `sync_every` matmuls and waits for them."""
    import torch  # type: ignore[import-not-found, unused-ignore]  # lazy: --help works without torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(size, size, device=dev, dtype=torch.bfloat16)

    def step() -> int:
        for _ in range(sync_every):
            torch.mm(a, b, out=out)
        torch.cuda.synchronize(dev)
        return sync_every

    info = {
        "device_name": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    return step, info


def make_client_step(size: int, matmuls: int, device: str, tenant: str, weight: int,
                     socket: str | None) -> tuple[Callable[[], int], dict[str, Any]]:
    """A step of `matmuls` matmuls inside `client.step()`: the lease gates it and CUDA events time it, with one or
    two steps in flight (unisched_client.torch), never synchronised one by one."""
    import torch  # type: ignore[import-not-found, unused-ignore]

    from unisched_client import Client  # type: ignore[import-not-found, unused-ignore]

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False (no GPU or no CUDA driver)")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=dev, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(size, size, device=dev, dtype=torch.bfloat16)
    client = Client(tenant, weight, socket=socket)
    gated = client.step()

    def step() -> int:
        with gated:
            for _ in range(matmuls):
                torch.mm(a, b, out=out)
        return matmuls

    return step, {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "client": tenant, "weight": weight}


def main(argv: list[str] | None = None) -> int:
    process_start = time.time()
    args = parse_args(argv)
    start_at, end_at = plan_window(args, process_start)
    try:
        if args.client:
            step, info = make_client_step(args.size, args.sync_every, args.device, args.client, args.weight,
                                          args.socket)
        else:
            step, info = make_step(args.size, args.sync_every, args.device)
    except ImportError as exc:
        return fail(f"PyTorch is not importable: {exc}")
    except RuntimeError as exc:
        return fail(f"CUDA is not usable: {exc}")
    window = measure(step, start_at, end_at)
    flops = 2.0 * args.size ** 3
    extra = {
        "size": args.size,
        "sync_every": args.sync_every,
        "dtype": "bfloat16",
        "tflops": window.throughput * flops / 1e12,
        **info,
    }
    report = write_report(args.report, KIND, UNIT, window, extra)
    late = f", started {window.late_s:.1f} s late" if window.late_s > 0.5 else ""
    print(f"cuda_matmul pid={report['pid']}: {window.throughput:.1f} {UNIT} "
          f"({window.items} matmuls in {window.seconds:.2f} s, {args.size}^2 bf16, "
          f"{extra['tflops']:.0f} TFLOP/s, {info['device_name']}{late})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
