# Three rounds of bench/registration_load.py (as at 5d2ba50, from the project root) alternating the product at
# 72d8238 (the move on the event loop), dcbad4f (on the move thread, first come first served) and 5d2ba50 (users in turn: ad130d9 onwards).
set -e
export PYTHONPATH=$PWD:$PWD/clients
OUT=${OUT:-bench/results/2026-12-05-cpu-5d2ba50-registrations}
for c in 72d8238 dcbad4f; do
  [ -d /tmp/ab/code-$c ] || { mkdir -p /tmp/ab/code-$c; git archive $c | tar -C /tmp/ab/code-$c -x; }
done
for i in 1 2 3; do
  python3 bench/registration_load.py --root /tmp/ab/code-72d8238 --out $OUT/72d8238-$i
  python3 bench/registration_load.py --root /tmp/ab/code-dcbad4f --out $OUT/dcbad4f-$i
  python3 bench/registration_load.py --out $OUT/5d2ba50-$i
done
