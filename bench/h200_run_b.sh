#!/usr/bin/env bash
# Device call B of 2026-12-01: the unused-turn rule (NVML utilization, mean >= 0.98 over 0.4 s, unused turns hold
# the GPU open 2..30 s, a CPU-busy holder used its turn) on the mixed pairs and the scenarios; daemon gate logs kept.
# Run: source .devcache/setup.sh && bash bench/h200_run_b.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --work-dir /tmp/pairs-work --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 250 2>&1 | tee "$OUT/mixed-kernel.log" | grep "| unisched\|no scheduler" | tail -8
mkdir -p /tmp/gates
find /tmp/pairs-work -name daemon.log | while read -r f; do grep -E "slicing|lending|busy signal" "$f" | tail -c 100000 > "/tmp/gates/pairs_$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
STEPS=scenarios SCEN=ad_sim,cloud SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12 --max-total 330" bash bench/gpu_session.sh 2>&1 | tail -12
find /tmp/scen-work -name "*daemon*.log" | while read -r f; do grep -E "slicing|lending" "$f" | tail -c 100000 > "/tmp/gates/scen_$(echo "${f#/tmp/scen-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf results-b.tgz mixed-kernel mixed-kernel.log scenarios scenarios.log -C /tmp gates && ls
