#!/usr/bin/env bash
# A device call of 2026-12-01 (run at 02:26 UTC as the second session's first call; results in bench/results/2026-12-01-h200-d/): what this session could not check on the GPU.
#   1. the examples (01-05) on the framed lease stream the client library now speaks (it left gRPC after the last
#      GPU run), 2. the renewal round trip on the H200 (protocol and library clients), 3. the mixed training + render
#      pairs under the kernel engine after "unused turns must last 0.4 s", with the daemon's per-slice debug lines.
# Run: source .devcache/setup.sh && bash bench/h200_next.sh   (carry .devcache; results under $OUT)
# A second call should re-run the online scenario (the no-signal rule for invisible compute changes the kernel
# engine's row): STEPS=scenarios SCEN=online SCEN_ARGS="--seconds 12 --warmup 8 --unisched-warmup 12 --max-total 500"
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gates
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_examples_gpu.py 2>&1 | tee "$OUT/pytest-examples.log" | grep -E "passed|failed|FAILED|SKIPPED|^0[1-5]_" | tail -20
for client in protocol library; do
  timeout 45 python3 bench/lease_load.py --tenants 1 --seconds 15 --warmup 3 --renew-ms 25 --client "$client" --out "$OUT/lease-rtt-$client" 2>&1 | tail -2
done
python3 bench/gpu_pairs.py --out "$OUT/mixed-kernel" --work-dir /tmp/pairs-work --pairs mixed1:1,mixed3:1,mixed1:3 \
  --workload-cmd-cuda "python3 examples/02_pytorch_training.py --model resnet50 --batch 32" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 --engine kernel \
  --seconds 12 --warmup 10 --unisched-warmup 12 --slice-ms 50 --max-total 250 --serve-arg=--log-level --serve-arg=debug \
  2>&1 | tee "$OUT/mixed-kernel.log" | grep "| unisched\|no scheduler\|alone" | tail -8
find /tmp/pairs-work -name daemon.log | while read -r f; do
  grep -E '"(slicing|lending|turn)"' "$f" | tail -c 400000 > "/tmp/gates/$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf results-next.tgz pytest-examples.log lease-rtt-* mixed-kernel mixed-kernel.log -C /tmp gates && ls
