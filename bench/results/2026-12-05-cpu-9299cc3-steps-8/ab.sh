# The cloud-gaming suite's CPU stand-in, one round at a time alternating the product at 8a1304d (a rationed slice in
# 4 steps of 12.5 ms) and 9299cc3 (branch exp-steps8: 8 steps of 6.25 ms, ration_run_steps 16 for the same 100 ms),
# three rounds each, each commit's own checkout (git archive) running its own runner. From the project root. The
# runner exits 1 once a settled target is missed: each run is followed by `|| true`.
set -e
OUT=${OUT:-$PWD/bench/results/2026-12-05-cpu-9299cc3-steps-8}
for c in 8a1304d 9299cc3; do
  [ -d /tmp/ab/code-$c ] || { mkdir -p /tmp/ab/code-$c; git archive $c | tar -C /tmp/ab/code-$c -x; }
done
for i in 1 2 3; do
  for c in 8a1304d 9299cc3; do
    (cd /tmp/ab/code-$c && PYTHONPATH=$PWD:$PWD/clients python3 bench/run.py cloud-gaming --cpu-standin --rounds $i \
       --out $OUT/$c --commit $c) || true
  done
done
