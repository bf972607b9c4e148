#!/usr/bin/env bash
# A device call of 2026-12-01 (run at 03:32 UTC, 157 s; results in bench/results/2026-12-01-h200-e/call-a/): mixed slices for compute + graphics that overlap
# partly (`unisched serve --contention auto-mixed`, policy/overlap.py), never measured on a GPU. gpu_pairs'
# --calibrate-out turns this run's own no-scheduler cuda+render pair into the daemon's contention.json, so the
# unisched runs use the kept rates just measured (12-01: 0.22 / 0.92, a partial overlap).
# Compare with bench/results/2026-12-01-h200-d/ (call-next/mixed-kernel: sliced, sums 0.96-0.99, 2.6-5.0 pts).
# (`auto-mixed` has since become what `auto` does and is gone: drop that --serve-arg pair to run this again.)
# Run: source .devcache/setup.sh && bash bench/h200_pending.sh   (carry .devcache; results under $OUT)
# A second call should repeat the online scenario in rounds, each with its own solo runs (12-01's single runs had
# solo references 20% off): STEPS=scenarios SCEN=online SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12
# --online-batches 1 --repeat 3 --max-total 540" bash bench/gpu_session.sh   (~7.5 min)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/gpu_pairs.py --out "$OUT/mixed-auto-mixed" --work-dir /tmp/pairs-work --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --calibrate-out /tmp/calibration --serve-arg=--contention --serve-arg=auto-mixed \
  --serve-arg=--log-level --serve-arg=debug \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 300 \
  2>&1 | tee "$OUT/mixed-auto-mixed.log" | grep "| unisched\|no scheduler\|alone\|contention" | tail -10
cp /tmp/calibration/contention.json "$OUT/" 2>/dev/null
cd "$OUT" && tar czf results-pending.tgz mixed-auto-mixed mixed-auto-mixed.log contention.json 2>/dev/null; ls
