"""How finely does NVML see GPU activity on this machine? Prints the spacing of nvmlDeviceGetSamples
utilization samples and their values while a CUDA load runs, so slice lengths and charging can be chosen
against what the driver really reports. Run on the GPU machine: python3 bench/nvml_probe.py --seconds 6"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time

BURN = (
    "import torch,time\nx=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\nend=time.time()+{s}\n"
    "while time.time()<end:\n    for _ in range(4): y=x@x\n    torch.cuda.synchronize()\n"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--json", help="write the findings here")
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    load = subprocess.Popen([sys.executable, "-c", BURN.format(s=args.seconds)])
    last = 0
    stamps: list[int] = []
    values: list[int] = []
    polls = 0
    end = time.monotonic() + args.seconds + 2
    while time.monotonic() < end:
        polls += 1
        try:
            _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last)
        except pynvml.NVMLError as e:
            print("nvmlDeviceGetSamples failed:", e)
            samples = []
        for s in samples:
            if s.timeStamp > last:
                stamps.append(s.timeStamp)
                values.append(s.sampleValue.uiVal)
        if samples:
            last = max([last, *(s.timeStamp for s in samples)])
        time.sleep(0.01)
    load.wait()
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
    out = {
        "gpu": pynvml.nvmlDeviceGetName(h),
        "polls": polls,
        "samples": len(stamps),
        "gap_ms_median": statistics.median(gaps) if gaps else None,
        "gap_ms_p90": sorted(gaps)[int(0.9 * len(gaps))] if gaps else None,
        "values_head": values[:40],
    }
    print(json.dumps(out, indent=1, default=str))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
