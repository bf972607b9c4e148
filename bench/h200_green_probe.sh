#!/usr/bin/env bash
# Issue 5: would a trainer narrowed onto a green context only while requests run keep more than the static MPS cap
# (0.47-0.50 at 30%, 0.73-0.76 at 60% beside a b128 trainer; bench/results/2026-12-02-h200-b)? bench/green_ctx_probe.py,
# written in the tenth session, not yet run: a b128 step on N SMs, the cost of switching, alone and under MPS (~3 min;
# each half stopped after 150 s):
#   source .devcache/setup.sh && bash bench/h200_green_probe.sh          (carry: [".devcache"])
set -uo pipefail
source bench/preflight.sh
record_machine
timeout 150 python3 bench/green_ctx_probe.py --out "$OUT/green" 2>&1 | tee "$OUT/green.log" | tail -15
timeout 150 python3 bench/green_ctx_probe.py --out "$OUT/green-mps" --mps 2>&1 | tee "$OUT/green-mps.log" | tail -15
cd "$OUT" && tar czf results-green.tgz --ignore-failed-read green green-mps green.log green-mps.log machine.txt; ls
