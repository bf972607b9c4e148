# Three rounds of bench/registration_load.py (as at bcdccf1, from the project root) alternating the product at
# 5c8b6dc (h2's 100 calls in flight a connection) and bcdccf1 (4 a non-admin connection).
set -e
export PYTHONPATH=$PWD:$PWD/clients
OUT=${OUT:-bench/results/2026-12-05-cpu-bcdccf1-grpc-calls}
[ -d /tmp/ab2/code-5c8b6dc ] || { mkdir -p /tmp/ab2/code-5c8b6dc; git archive 5c8b6dc | tar -C /tmp/ab2/code-5c8b6dc -x; }
for i in 1 2 3; do
  python3 bench/registration_load.py --root /tmp/ab2/code-5c8b6dc --out $OUT/5c8b6dc-$i
  python3 bench/registration_load.py --out $OUT/bcdccf1-$i
done
