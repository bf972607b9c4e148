#!/usr/bin/env bash
# A device call of 2026-12-01 (3rd session): mixed slices as the default (`--contention auto` mixes a calibrated
# partial overlap whose kept rates sum >= 1.05), runs of each kind for their part of a 1 s period, and cooperative
# tenants' leases following the mix. Kernel engine 1:1, 3:1, 1:3, then the user engine (examples 02 + 03 as clients)
# 1:1 and 3:1; each gpu_pairs calibrates from its own no-scheduler run. Daemons' slicing/mix lines kept.
# Run: source .devcache/setup.sh && bash bench/h200_mix_default.sh   (carry .devcache; results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
for engine in kernel user; do
  pairs=mixed1:1,mixed3:1,mixed1:3; budget=200
  [ "$engine" = user ] && pairs=mixed1:1,mixed3:1 && budget=190
  rm -rf /tmp/pairs-work
  python3 bench/gpu_pairs.py --out "$OUT/mix-$engine" --work-dir /tmp/pairs-work --pairs $pairs --engine $engine \
    --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
    --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 \
    --calibrate-out /tmp/calibration-$engine --serve-arg=--log-level --serve-arg=debug \
    --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total $budget \
    2>&1 | tee "$OUT/mix-$engine.log" | grep "| unisched\|no scheduler\|calibration" | tail -6
  cp /tmp/calibration-$engine/contention.json "$OUT/mix-$engine/" 2>/dev/null
  find /tmp/pairs-work -name daemon.log | while read -r f; do
    grep -E '"(slicing|lending|mixed slices|mixed slice|measured contention)"' "$f" | tail -c 200000 > "/tmp/gates/$engine-$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
done
cd "$OUT" && tar czf results-mix-default.tgz mix-* -C /tmp gates && ls
