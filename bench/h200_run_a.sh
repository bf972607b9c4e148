#!/usr/bin/env bash
# Device call A of 2026-12-01: the kernel engine's saturation signal (GPM busy fraction, 0.98 for 0.2 s) on the
# scenarios it decides (driving sim, cloud gaming N=1..16) and on the mixed training + render pairs it must still
# slice. Run: source .devcache/setup.sh && bash bench/h200_run_a.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 250 2>&1 | tee "$OUT/mixed-kernel.log" | grep -v "^ " | tail -12
STEPS=scenarios SCEN=ad_sim,cloud SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12 --max-total 300" bash bench/gpu_session.sh 2>&1 | tail -25
cd "$OUT" && tar czf results-a.tgz mixed-kernel scenarios scenarios.log mixed-kernel.log machine.txt && ls
