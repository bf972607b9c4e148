#!/usr/bin/env bash
# Diagnose a cooperative pair on the GPU: two 02 (PyTorch) tenants at 3:1 under a daemon with debug logs;
# prints their throughputs, the daemon's tenants and a summary of grants, revokes and reports per tenant.
set -uo pipefail
OUT=${OUT:-/tmp/out}; D=$OUT/coop-diag; mkdir -p $D
MODEL=${MODEL:-mlp}
python3 -m unisched serve --socket $D/d.sock --state-dir $D/state --log-level debug --log-format json > $D/daemon.log 2>&1 &
DPID=$!
for i in $(seq 50); do [ -S $D/d.sock ] && break; sleep 0.1; done
timeout 120 python3 examples/05_side_by_side.py --a 02 --b 02 --a-weight 300 --b-weight 100 --seconds 10 --warmup 8 \
  --socket $D/d.sock --out $D -- --model $MODEL 2>&1 | tail -8
python3 -m unisched tenants --socket $D/d.sock
kill $DPID; wait $DPID
python3 - "$D/daemon.log" <<'PY'
import json, sys, collections
ev = collections.Counter(); gpu = collections.Counter(); reasons = collections.Counter()
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    e = json.loads(line)
    t = e.get("tenant", "")
    if e["event"] in ("lease granted", "lease revoked", "lease report", "lease not renewed; revoked", "share"):
        ev[(t, e["event"])] += 1
    if e["event"] == "lease report":
        gpu[t] += e["gpu_s"]
    if e["event"] == "lease revoked":
        reasons[(t, e["reason"])] += 1
for k, v in sorted(ev.items()): print(k, v)
print("reported gpu_s", dict(gpu)); print("revoke reasons", dict(reasons))
PY
