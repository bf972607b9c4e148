#!/usr/bin/env bash
# Device call E of 2026-12-01 (second session): the online + offline scenario at batch 1 and 8 after the kernel
# engine's no-signal rule for invisible compute, and the cooperative ResNet-50 b32 + render pair at 1:3 (the user
# engine's 3.7-point miss in scenario 1) on the lease stream without gRPC.
# Run: source .devcache/setup.sh && bash bench/h200_run_e.sh   (carry .devcache; results under $OUT, ~7 min)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=scenarios SCEN=online SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12 --online-batches 1,8 --max-total 300" \
  bash bench/gpu_session.sh 2>&1 | tail -16
python3 bench/gpu_pairs.py --engine user --out "$OUT/coop-mixed" --work-dir /tmp/coop-work \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 \
  --seconds 12 --warmup 12 --unisched-warmup 15 --max-total 150 --pairs mixed1:3 \
  2>&1 | tee "$OUT/coop-mixed.log" | grep "| unisched\|no scheduler\|alone" | tail -4
cd "$OUT" && tar czf results-e.tgz scenarios scenarios.log coop-mixed coop-mixed.log && ls
