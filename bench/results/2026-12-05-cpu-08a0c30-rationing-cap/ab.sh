# The cloud-gaming suite's CPU stand-in, one round at a time alternating the product at 36a7132 (the cap on how many
# sit out only falls, once a slice) and 08a0c30 (lowered at most once in 0.2 s, raised after 5 s), three rounds each,
# each commit's own checkout (git archive) running its own runner. From the project root.
set -e  # (the runner exits 1 once a settled target is missed: each run is followed by `|| true`)
OUT=${OUT:-$PWD/bench/results/2026-12-05-cpu-08a0c30-rationing-cap}
for c in 36a7132 08a0c30; do
  [ -d /tmp/ab/code-$c ] || { mkdir -p /tmp/ab/code-$c; git archive $c | tar -C /tmp/ab/code-$c -x; }
done
for i in 1 2 3; do
  for c in 36a7132 08a0c30; do
    (cd /tmp/ab/code-$c && PYTHONPATH=$PWD:$PWD/clients python3 bench/run.py cloud-gaming --cpu-standin --rounds $i \
       --out $OUT/$c --commit $c) || true
  done
done
