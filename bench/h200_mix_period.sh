#!/usr/bin/env bash
# A device call of 2026-12-01 (3rd session): mixed slices (`--contention auto-mixed`) with runs of each kind lasting
# their part of a period (MixTurns.period_s, `--mix-period-ms`), after the first GPU run of mixed slices
# (bench/results/2026-12-01-h200-e/mixed-auto-mixed: 50 ms slices alternating BBC..., the trainer 4-8 points short,
# the render over by the frame it finished after each pause). Periods 1000 and 2000 ms, pairs 1:1 and 3:1, each run
# calibrating from its own no-scheduler run; the daemons' slicing/mix lines kept.
# (Run with `--serve-arg=--contention --serve-arg=auto-mixed`; mixed slices have since become what `auto` does, and
# that value is gone.)
# Run: source .devcache/setup.sh && bash bench/h200_mix_period.sh   (carry .devcache; results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
for period in ${PERIODS:-1000 2000}; do
  rm -rf /tmp/pairs-work
  python3 bench/gpu_pairs.py --out "$OUT/mix-$period" --work-dir /tmp/pairs-work --pairs ${PAIRS:-mixed1:1,mixed3:1} \
    --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
    --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
    --calibrate-out /tmp/calibration-$period \
    --serve-arg=--mix-period-ms --serve-arg=$period --serve-arg=--log-level --serve-arg=debug \
    --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 280 \
    2>&1 | tee "$OUT/mix-$period.log" | grep "| unisched\|no scheduler\|calibration" | tail -6
  cp /tmp/calibration-$period/contention.json "$OUT/mix-$period/" 2>/dev/null
  find /tmp/pairs-work -name daemon.log | while read -r f; do
    grep -E '"(slicing|lending|mixed slices|mixed slice)"' "$f" | tail -c 300000 > "/tmp/gates/$period-$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
done
cd "$OUT" && tar czf results-mix.tgz mix-* -C /tmp gates && ls
