#!/usr/bin/env bash
# The render pairs of the mixed suite in one device call (about 7 minutes on an H200, an estimate: 3 rounds of
# 2 alone runs + 5 pairs, each about 20 s with its warm-up, window and daemon start/stop):
#   frame+render  egl_render.py --client (every frame inside FrameGate) against the same render unmodified under
#                 `unisched run --engines graphics`, at 1:1, 3:1, 1:3
#   frame+frame   two frame clients, at 1:1 and 3:1
# Every round through bench/run.py (verdicts: error <= 1 pt median, <= 2 worst, sum >= 0.98, guarantee).
# From the project root:  source .devcache/setup.sh && OUT=$OUT COMMIT=<sha> bash bench/mixed_render.sh
# -> $OUT/results/mixed/{summary.json,report.md,raw.tar.xz}, $OUT/mixed_render.log, $OUT/gpu.txt
# ROUNDS=1 for a quick look (about 2.5 minutes). A call cut short keeps the rounds done: run it again with the same
# OUT and COMMIT to add the rest.
set -o pipefail
OUT=${OUT:-bench/results/$(date +%F)-mixed-render}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
: "${COMMIT:?no git metadata here: name the commit measured, COMMIT=<sha>}"
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/clients
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
python3 bench/run.py mixed --rounds "${ROUNDS:-3}" --out "$OUT/results" --commit "$COMMIT" -- \
    --pairs frame+render,frame+frame --commit "$COMMIT" 2>&1 | tee "$OUT/mixed_render.log"
