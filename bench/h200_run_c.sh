#!/usr/bin/env bash
# Device call C of 2026-12-01: cloud gaming and the 1:1 mixed pair after the compute-only CPU stand-in for unused turns.
# Run: source .devcache/setup.sh && bash bench/h200_run_c.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
STEPS=scenarios SCEN=cloud SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12 --max-total 240" bash bench/gpu_session.sh 2>&1 | tail -9
find /tmp/scen-work -name "*daemon*.log" | while read -r f; do grep -E "slicing|lending" "$f" | tail -c 100000 > "/tmp/gates/scen_$(echo "${f#/tmp/scen-work/}" | tr / _).gate"; done
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --work-dir /tmp/pairs-work --pairs mixed1:1 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 130 2>&1 | tee "$OUT/mixed-kernel.log" | grep "| unisched\|no scheduler\|alone" | tail -4
find /tmp/pairs-work -name daemon.log | while read -r f; do grep -E "slicing|lending" "$f" | tail -c 100000 > "/tmp/gates/pairs_$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf results-c.tgz mixed-kernel mixed-kernel.log scenarios scenarios.log -C /tmp gates && ls
