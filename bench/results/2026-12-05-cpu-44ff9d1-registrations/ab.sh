# Three rounds alternating the product before (72d8238) and after (57f4e0b onwards, run at 44ff9d1) the cgroup move
# left the event loop; run as root from the project root.
set -e
export PYTHONPATH=$PWD:$PWD/clients
R=bench/results/2026-12-05-cpu-44ff9d1-registrations
rm -rf /tmp/old-reg && mkdir -p /tmp/old-reg && git archive 72d8238 | tar -C /tmp/old-reg -x
for i in 1 2 3; do
  python3 bench/registration_load.py --root /tmp/old-reg --out $R/before-$i
  python3 bench/registration_load.py --out $R/after-$i
done
