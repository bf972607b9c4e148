# The cloud-gaming suite's CPU stand-in, one round at a time alternating the product at 331a21a (no limit on how
# many steps in a row a rationed tenant sits out) and 26f9f9f (one that sat out 8 in a row yields its place to
# another ahead), three rounds each, each commit's own checkout (git archive) running its own runner. From the
# project root. The runner exits 1 once a settled target is missed: each run is followed by `|| true`.
set -e
OUT=${OUT:-$PWD/bench/results/2026-12-05-cpu-26f9f9f-run-steps}
for c in 331a21a 26f9f9f; do
  [ -d /tmp/ab/code-$c ] || { mkdir -p /tmp/ab/code-$c; git archive $c | tar -C /tmp/ab/code-$c -x; }
done
for i in 1 2 3; do
  for c in 331a21a 26f9f9f; do
    (cd /tmp/ab/code-$c && PYTHONPATH=$PWD:$PWD/clients python3 bench/run.py cloud-gaming --cpu-standin --rounds $i \
       --out $OUT/$c --commit $c) || true
  done
done
