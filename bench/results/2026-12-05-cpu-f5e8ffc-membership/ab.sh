# Three rounds of bench/registration_load.py (as at f5e8ffc, from the project root) alternating the product at
# ae089f8 (a known tenant's membership read on the event loop) and f5e8ffc (read on the move thread).
set -e
export PYTHONPATH=$PWD:$PWD/clients
OUT=${OUT:-bench/results/2026-12-05-cpu-f5e8ffc-membership}
for c in ae089f8 f5e8ffc; do
  [ -d /tmp/ab/code-$c ] || { mkdir -p /tmp/ab/code-$c; git archive $c | tar -C /tmp/ab/code-$c -x; }
done
for i in 1 2 3; do
  python3 bench/registration_load.py --root /tmp/ab/code-ae089f8 --out $OUT/ae089f8-$i
  python3 bench/registration_load.py --root /tmp/ab/code-f5e8ffc --out $OUT/f5e8ffc-$i
done
