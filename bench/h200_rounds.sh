#!/usr/bin/env bash
# Ran in the fifth session of 12-01 (bench/results/2026-12-01-h200-f/): the kernel call and the b128 user call below,
# and the overhead call; in the sixth (../2026-12-01-h200-g/): ENGINE=user (the mixed pair as clients, and at 1:3
# with PAIRS=mixed1:3 REPEAT=1) and the matmul pair at the end (mixed). Not run: the matmul pair with CONTENTION=auto.
# Device calls (written 2026-12-01): pairs in rounds, each scored against solo runs taken
# before and after its shared ones (gpu_pairs --repeat --solo-after). Why: on 12-01 the ResNet-50 b32 trainer alone
# measured 1322-2109 img/s between invocations (bench/results/2026-12-01-h200-e/), so single-run verdicts measured
# the reference's drift as much as the scheduler. Each round calibrates from its own no-scheduler run (mixed slices
# are the default for a calibrated partial overlap). Three calls of ~6-7 min each:
#   source .devcache/setup.sh && ENGINE=kernel bash bench/h200_rounds.sh     # mixed b32 + render, 1:1 and 3:1
#   source .devcache/setup.sh && ENGINE=user bash bench/h200_rounds.sh       # the same as cooperative clients
#   source .devcache/setup.sh && ENGINE=user PAIRS=cuda3:1,render3:1 BATCH=128 REPEAT=2 bash bench/h200_rounds.sh
#       # (estimated 508 s; --overhead would add ~140 s past the 540 s cap: measure it in a call of its own,
#       # PAIRS=cuda3:1 BATCH=128 REPEAT=1 EXTRA=--overhead)
#       # issue 4: the b128 trainer pair (sum 0.89-0.94 in single runs, before the client kept one step in flight
#       # while contended and the daemon gave long units turns of 8: bench/results/2026-12-01-cpu/handover-model/
#       # models 0.96 -> 0.99), the render pair (no long turns for frames; one frame in flight while contended),
#       # (one tenant's overhead, 1.8-3.0% so far, in the call noted above).
#       # The daemon logs "lease turns" (unit_ms, min_run_ms) per tenant: the gates below keep those lines.
# Then, if time is left: the contended matmul + render pair (issue 2), mixed in runs of 1 s by partial-overlap (the
# model keeps the matmul tenant 1.5 points from plan: bench/results/2026-12-01-cpu/mix-model/contended-matmul-pair/)
# and sliced as before (CONTENTION=auto): ENGINE=kernel PAIRS=mixed1:1,mixed1:3 CUDA_CMD="python3
#   examples/workloads/cuda_matmul.py" [CONTENTION=auto] bash bench/h200_rounds.sh
# Warm-ups of 16 s (were 10 / 12): on 12-01 the trainer's first step came 4-7 s into the window of every no-scheduler
# run beside the render; such a pair is now scored over the seconds both ran, which a longer warm-up keeps near 12.
set -uo pipefail
source bench/preflight.sh
ENGINE=${ENGINE:-kernel}
TAG=${TAG:-$ENGINE}
CUDA_CMD=${CUDA_CMD:-python3 examples/02_pytorch_training.py --model resnet50 --batch ${BATCH:-32}}
mkdir -p /tmp/gates
calibrate=(--calibrate-out /tmp/calibration --serve-arg=--contention --serve-arg="${CONTENTION:-partial-overlap}")
# (partial-overlap: mixed slices from each round's calibration even where its sum falls under MIX_SUM = 0.97; the
# b32 pair's sums, scored over the seconds both ran, were 1.03-1.13 on 12-01, the matmul pair's 1.00.
# CONTENTION=auto lets the sum decide.)
case "${PAIRS:-mixed}" in *mixed*) ;; *) calibrate=() ;; esac
python3 bench/gpu_pairs.py --out "$OUT/rounds-$TAG" --work-dir /tmp/pairs-work --pairs "${PAIRS:-mixed1:1,mixed3:1}" \
  --engine "$ENGINE" --repeat "${REPEAT:-2}" --solo-after --workload-cmd-cuda "$CUDA_CMD" \
  --workload-cmd-render "python3 examples/03_egl_render.py" --render-iterations 447 "${calibrate[@]}" \
  --serve-arg=--log-level --serve-arg=debug --seconds 12 --warmup "${WARMUP:-16}" --unisched-warmup "${UWARMUP:-16}" --max-total 540 ${EXTRA:-} \
  2>&1 | tee "$OUT/rounds-$TAG.log" | grep -E "^\| |Alone, per round|loss per round|round [0-9]: alone" | tail -14
# the daemons' slicing and mix lines, and (user engine) their lease grants and revokes: why a render got more than
# its planned share on 12-01 (call-d: 0.67 against 0.57) is not known yet
find /tmp/pairs-work -name daemon.log | while read -r f; do
  grep -E '"(slicing|lending|mixed slices|mixed slice|measured contention|lease granted|lease revoked|lease turns)"' "$f" \
    | tail -c 150000 > "/tmp/gates/$(echo "${f#/tmp/pairs-work/}" | tr / _).gate"; done
cd "$OUT" && tar czf "results-rounds-$TAG.tgz" "rounds-$TAG" "rounds-$TAG.log" -C /tmp gates && ls
