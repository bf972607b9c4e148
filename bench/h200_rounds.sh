#!/usr/bin/env bash
# The next device call (written 2026-12-01, not yet run; ~7 min): the mixed training + render pairs in rounds, each
# scored against solo runs taken before and after its shared ones (gpu_pairs --repeat --solo-after). Why: on 12-01
# the ResNet-50 b32 trainer alone measured 1322-2109 img/s between invocations (bench/results/2026-12-01-h200-e/),
# so single-run verdicts measured the reference's drift as much as the scheduler. Mixed slices are the default for
# the calibrated partial overlap; each round calibrates from its own no-scheduler run.
# Run: source .devcache/setup.sh && ENGINE=kernel bash bench/h200_rounds.sh   (then ENGINE=user; carry .devcache)
set -uo pipefail
OUT=${OUT:-/tmp/out}
ENGINE=${ENGINE:-kernel}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
python3 bench/gpu_pairs.py --out "$OUT/rounds-$ENGINE" --work-dir /tmp/pairs-work --pairs ${PAIRS:-mixed1:1,mixed3:1} \
  --engine "$ENGINE" --repeat ${REPEAT:-2} --solo-after \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 \
  --calibrate-out /tmp/calibration --serve-arg=--log-level --serve-arg=debug \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 520 \
  2>&1 | tee "$OUT/rounds-$ENGINE.log" | grep -E "^\| |Alone, per round|round [0-9]: alone" | tail -12
find /tmp/pairs-work -name daemon.log | while read -r f; do
  grep -E '"(slicing|lending|mixed slices|measured contention)"' "$f" | tail -c 100000 > "/tmp/gates/$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf "results-rounds-$ENGINE.tgz" "rounds-$ENGINE" "rounds-$ENGINE.log" -C /tmp gates && ls
