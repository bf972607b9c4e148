#!/bin/bash
# A/B of the lease renewal round trip: ddd7a44 (before) and 7fe13e8 (after), alternating, one tenant every 25 ms.
set -u
out=$1; mkdir -p $out
for sha in ddd7a44 7fe13e8; do [ -d /tmp/la/wt-$sha ] || git -C /work/main worktree add -q /tmp/la/wt-$sha $sha; done
for i in 1 2 3 4 5 6; do
  for sha in ddd7a44 7fe13e8; do
    R=/tmp/la/wt-$sha
    (cd $R && PYTHONPATH=$R:$R/clients taskset -c 0,1 python3 bench/lease_load.py --tenants 1 --seconds 15 --warmup 3 --renew-ms 25 --out $out/$sha-$i > /dev/null 2>&1)
    echo "round $i $sha: $(python3 -c "import json;d=json.load(open('$out/$sha-$i/results.json'))['rtt_ms'];print(d['p50'],d['p99'])")"
  done
done
