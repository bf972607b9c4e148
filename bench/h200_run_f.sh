#!/usr/bin/env bash
# Device call F of 2026-12-01 (second session, the last ~7 device minutes): the online scenario at batch 1 again with
# 30 s windows (call E's 12 s windows put the no-scheduler trainer above its solo rate), and the ResNet-50 b128 pair
# at 3:1 under the kernel engine, the like-for-like reference for the user engine's pair (issue 4).
# Run: source .devcache/setup.sh && bash bench/h200_run_f.sh   (carry .devcache; results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=scenarios SCEN=online SCEN_ARGS="--seconds 30 --warmup 8 --unisched-warmup 12 --online-batches 1 --max-total 280" \
  bash bench/gpu_session.sh 2>&1 | tail -8
python3 bench/gpu_pairs.py --engine kernel --out "$OUT/cuda-kernel" --work-dir /tmp/pairs-work \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 128" \
  --seconds 12 --warmup 15 --unisched-warmup 15 --max-total 130 --pairs cuda3:1 \
  2>&1 | tee "$OUT/cuda-kernel.log" | grep "| unisched\|no scheduler\|alone" | tail -4
cd "$OUT" && tar czf results-f.tgz scenarios scenarios.log cuda-kernel cuda-kernel.log && ls
