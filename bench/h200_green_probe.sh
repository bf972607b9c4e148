#!/usr/bin/env bash
# Issue 5: would a trainer narrowed onto a green context only while requests run keep more than a static MPS cap
# (0.47-0.50 at 30%, 0.73-0.76 at 60%, 0.83-0.87 at 70% beside a b128 trainer; bench/results/2026-12-02-h200-b, -c, -d)?
# bench/green_ctx_probe.py: a b128 step on N SMs and the cost of switching, alone and under MPS (~5 min):
#   source .devcache/setup.sh && bash bench/h200_green_probe.sh          (carry: [".devcache"])
# First run (12-02, bench/results/2026-12-02-h200-c/call-a): 112 SMs worked (forward 0.86 of the whole device's rate,
# the step 0.99), then the process stopped answering in the driver, where `timeout`'s SIGTERM could not reach Python,
# and took the call's whole limit. So now each size runs in its own process, killed 5 s after its SIGTERM, each
# writes its results after every setting, and an MPS server left behind by a killed client is told to quit. Each
# size also times a step with the context pushed on autograd's backward thread (--narrow-backward), the rate of a
# trainer narrowed whole; ~5 min in all, and no probe starts after BUDGET_S (default 450) seconds, so a call of 600 s
# always comes back with what was measured.
# Second run (12-02, twelfth session, SIZES=66 BUDGET_S=140, bench/results/2026-12-02-h200-d/call-d): 66 SMs worked
# alone and under MPS (forward 0.66-0.67 kept, the step narrowed whole 0.70 alone, 0.78 under MPS); the switching
# test's first step on 40 SMs never finished, alone (killed) and under MPS (exit 124). Now each size times its forward
# passes before its step, and the switching test runs on 66 SMs.
set -uo pipefail
source bench/preflight.sh
record_machine
SIZES="${SIZES:-112 92 66 40 24}"
probe() {  # probe <folder> <seconds> <args...>
  local dir="$1" limit="$2"; shift 2
  if [ "$SECONDS" -gt "${BUDGET_S:-450}" ]; then echo "skipped $dir: the script is past ${BUDGET_S:-450} s"; return; fi
  mkdir -p "$dir"
  timeout -k 5 "$limit" python3 bench/green_ctx_probe.py --out "$dir" "$@" 2>&1 | tee -a "$dir.log" | tail -4
  echo "exit ${PIPESTATUS[0]}" | tee -a "$dir.log"
  if [ -d "$dir/mps/mps-pipe" ]; then echo quit | CUDA_MPS_PIPE_DIRECTORY="$dir/mps/mps-pipe" timeout 10 nvidia-cuda-mps-control; fi
}
for mode in green green-mps; do
  extra=(); [ "$mode" = green-mps ] && extra=(--mps)
  for n in $SIZES; do probe "$OUT/$mode/sms-$n" 75 --sms "$n" --switch-sms 0 --narrow-backward "${extra[@]}"; done
  probe "$OUT/$mode/switch" 75 --sms 66 --switch-sms 66 "${extra[@]}"
done
cd "$OUT" && tar czf results-green.tgz --ignore-failed-read green green-mps machine.txt; ls
