"""Can the daemon see GPU activity finely enough to measure the drain of a frozen tenant?

Uses NVML GPM (Hopper+): SM and graphics-engine activity between any two samples, so activity can be read
over a few milliseconds instead of NVML's 200 ms utilization samples. For three loads (CUDA syncing every 4
matmuls, CUDA queueing 200 matmuls before syncing, the EGL render load) it SIGSTOPs the process (what a
freeze does to its CPU threads) and prints how long the GPU stays busy afterwards: the drain.
Run on the GPU machine: python3 bench/gpm_probe.py --json out.json"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CUDA = (
    "import torch,time\nx=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
    "while True:\n    for _ in range({q}): y=x@x\n    torch.cuda.synchronize()\n"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json")
    ap.add_argument("--step-ms", type=float, default=2.0)
    args = ap.parse_args()
    import pynvml as n

    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    out: dict[str, Any] = {}
    try:
        try:
            sup = n.nvmlGpmQueryDeviceSupport(h)  # nvidia-ml-py <= 12.x
        except TypeError:
            sup = n.c_nvmlGpmSupport_t()
            sup.version = n.NVML_GPM_SUPPORT_VERSION
            n.nvmlGpmQueryDeviceSupport(h, sup)
        out["gpm_supported"] = bool(sup.isSupportedDevice)
    except Exception as e:
        out["gpm_supported"] = f"error: {e!r}"
        print(json.dumps(out))
        return 1
    s1, s2 = n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()
    ids = [n.NVML_GPM_METRIC_SM_UTIL, n.NVML_GPM_METRIC_GRAPHICS_UTIL]

    def read(a: Any, b: Any) -> list[float]:
        mg = n.c_nvmlGpmMetricsGet_t()
        mg.version = n.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(ids)
        mg.sample1, mg.sample2 = a, b
        for i, m in enumerate(ids):
            mg.metrics[i].metricId = m
        n.nvmlGpmMetricsGet(mg)
        if any(mg.metrics[i].nvmlReturn for i in range(len(ids))):
            return [-float(mg.metrics[i].nvmlReturn) for i in range(len(ids))]
        return [mg.metrics[i].value for i in range(len(ids))]

    t0 = time.perf_counter()
    for _ in range(50):
        n.nvmlGpmSampleGet(h, s1)
    out["sample_cost_us"] = (time.perf_counter() - t0) / 50 * 1e6

    def timeline(seconds: float) -> list[tuple[float, float, float]]:
        rows = []
        start = time.perf_counter()
        n.nvmlGpmSampleGet(h, s1)
        a, b = s1, s2
        while time.perf_counter() - start < seconds:
            time.sleep(args.step_ms / 1000)
            n.nvmlGpmSampleGet(h, b)
            sm, gr = read(a, b)
            rows.append((round((time.perf_counter() - start) * 1000, 1), round(sm, 1), round(gr, 1)))
            a, b = b, a
        return rows

    p = subprocess.Popen([sys.executable, "-c", CUDA.format(q=4)], stdout=subprocess.DEVNULL)
    time.sleep(6)
    resolution = {}
    for step in (2.0, 10.0, 20.0, 50.0, 100.0, 200.0):
        args.step_ms = step
        rows = timeline(max(0.4, step * 6 / 1000))
        resolution[str(step)] = rows[-4:]
        print("step", step, rows[-4:], flush=True)
    out["resolution"] = resolution
    p.kill()
    p.wait()
    loads = {
        "cuda_sync4": [sys.executable, "-c", CUDA.format(q=4)],
        "cuda_queue200": [sys.executable, "-c", CUDA.format(q=200)],
        "render": [sys.executable, str(ROOT / "examples/workloads/egl_render.py"), "--iterations", "447",
                   "--seconds", "30", "--warmup", "0"],
    }
    for name, cmd in loads.items():
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        time.sleep(6)
        busy = timeline(0.3)
        os.kill(p.pid, signal.SIGSTOP)
        after = timeline(1.5)
        idle_at = next((t for t, sm, gr in after if sm < 3 and gr < 3), None)
        out[name] = {"busy_before": busy[-5:], "drain_ms": idle_at, "after_head": after[:40]}
        print(name, "drain_ms", idle_at, "busy", busy[-3:], flush=True)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
