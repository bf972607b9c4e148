#!/usr/bin/env bash
# Device call A2 of 2026-12-01: the per-50 ms busy fraction (GPM and NVML) of the loads the saturation gate must
# tell apart, then the mixed training + render pairs under the gate's mean-over-0.2 s rule, keeping daemon logs.
# Run: source .devcache/setup.sh && bash bench/h200_run_a2.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/saturation_signals.py --out "$OUT/signals-50ms" --every 0.05 --skip 7 \
  --phase 'train=python3 examples/02_pytorch_training.py --model resnet50 --batch 32 --seconds 10 --warmup 3' \
  --phase 'train+render=bash -c "python3 examples/02_pytorch_training.py --model resnet50 --batch 32 --seconds 12 --warmup 3 & python3 examples/03_egl_render.py --iterations 447 --seconds 12 --warmup 3; wait"' \
  --phase 'cloud16=python3 examples/cloud_gaming.py --instances 16 --seconds 10 --warmup 4 --out /tmp/cg16' 2>&1 | tail -4
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --work-dir /tmp/pairs-work --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 330 2>&1 | tee "$OUT/mixed-kernel.log" | grep "| unisched\|no scheduler" | tail -8
find /tmp/pairs-work -name daemon.log | while read -r f; do grep -E "slicing|lending|busy signal" "$f" | tail -c 200000 > "/tmp/pairs-work/$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf results-a2.tgz signals-50ms mixed-kernel mixed-kernel.log -C /tmp/pairs-work $(cd /tmp/pairs-work && ls *.gate 2>/dev/null) && ls
