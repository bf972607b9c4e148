#!/usr/bin/env python3
"""01: a pycuda kernel loop gated by unisched leases (CudaGate), printing its throughput and measured share.

Each step launches one grid of a compute-bound kernel (a long FMA chain per thread) and waits for it.
Under unisched (--tenant) each launch waits for the compute lease and is timed with CUDA events; the
measured GPU time is what the daemon charges.

  python3 examples/01_pycuda_kernel_loop.py --seconds 10                      # alone, no unisched
  python3 examples/01_pycuda_kernel_loop.py --seconds 10 --tenant k1 --weight 300
"""

from __future__ import annotations

import argparse
import sys
import time

from _coop import add_unisched_args, connect, share_line, share_report
from _window import add_window_args, fail, measure, plan_window, write_report

KERNEL = """
__global__ void burn(float *out, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float a = 1.0f + i * 1e-7f, b = 0.999999f, c = 1e-7f;
    for (int k = 0; k < iters; ++k) { a = a * b + c; b = b * a + c; }
    out[i] = a + b;
}
"""


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--iters", type=int, default=20000, help="FMA pairs per thread per launch (default 20000)")
    ap.add_argument("--blocks", type=int, default=4096, help="grid size (default 4096 blocks of 256)")
    add_unisched_args(ap)
    args = ap.parse_args(argv)
    start_at, end_at = plan_window(args, start)
    try:
        import numpy as np
        import pycuda.autoinit  # noqa: F401  (creates the context)
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule
    except ImportError as e:
        return fail(f"pycuda is not importable ({e}); pip install 'unisched[cuda]'")
    client = connect(args, ("compute",))
    burn = SourceModule(KERNEL).get_function("burn")
    out = cuda.mem_alloc(args.blocks * 256 * 4)
    iters = np.int32(args.iters)
    gate = None
    if client is not None:
        from unisched_client.cuda import CudaGate

        gate = CudaGate(client)

    def step() -> int:
        if gate is not None:
            with gate:
                burn(out, iters, block=(256, 1, 1), grid=(args.blocks, 1))
            gate.drain()  # one launch per step, waited for: the step's time is its completion
        else:
            burn(out, iters, block=(256, 1, 1), grid=(args.blocks, 1))
            cuda.Context.synchronize()
        return 1

    window = measure(step, start_at, end_at)
    share = share_report(client, "compute")
    report = write_report(args.report, "pycuda", "launch/s", window, {"share": share, "iters": args.iters})
    print(f"01_pycuda_kernel_loop pid={report['pid']}: {window.throughput:.1f} launch/s; {share_line(share)}", flush=True)
    if client is not None:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
