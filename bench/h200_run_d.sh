#!/usr/bin/env bash
# Device call D of 2026-12-01 (second session): the kernel engine charging by NVML's per-process samples (a frozen
# render's tail is its own), and the user engine with the hand-over that drains the revoked holder's queued units.
# Run: source .devcache/setup.sh && bash bench/h200_run_d.sh   (carry .devcache; results under $OUT, ~7-8 min)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$OUT/nvml-process-cost.txt"
import time, pynvml as n
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
t = time.perf_counter()
for _ in range(200):
    try: n.nvmlDeviceGetProcessUtilization(h, 0)
    except n.NVMLError: pass
print(f"nvmlDeviceGetProcessUtilization: {(time.perf_counter() - t) / 200 * 1e3:.3f} ms a call (idle GPU)")
PY
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --work-dir /tmp/pairs-work --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 200 --serve-arg=--log-level --serve-arg=debug \
  2>&1 | tee "$OUT/mixed-kernel.log" | grep "| unisched\|no scheduler\|alone" | tail -8
find /tmp/pairs-work -name daemon.log | while read -r f; do
  grep -E '"(slicing|lending|turn)"' "$f" | tail -c 300000 > "/tmp/gates/$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
python3 bench/gpu_pairs.py --engine user --overhead --out "$OUT/coop-pairs" --work-dir /tmp/coop-work \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 128" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 \
  --seconds 12 --warmup 15 --unisched-warmup 15 --max-total 250 --pairs cuda3:1,render3:1 \
  2>&1 | tee "$OUT/coop-pairs.log" | grep "| unisched\|no scheduler\|alone\|overhead\|loss" | tail -10
cd "$OUT" && tar czf results-d.tgz nvml-process-cost.txt mixed-kernel mixed-kernel.log coop-pairs coop-pairs.log -C /tmp gates && ls
