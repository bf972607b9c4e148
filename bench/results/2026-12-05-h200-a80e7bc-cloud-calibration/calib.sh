#!/bin/bash
# device diagnostics: store-bypass under the session hooks, then cloud-gaming player settings with no scheduler
D=$OUT/diag; mkdir -p $D; W=$(mktemp -d)
export PYTHONPATH=$PWD:$PWD/clients:$PYTHONPATH
{ uname -r; cat /proc/cmdline; echo "ssb: $(cat /sys/devices/system/cpu/vulnerabilities/spec_store_bypass)"; lscpu | grep -i "model name"; nproc; } > $D/kernel.txt 2>&1
python3 -m unisched serve --socket $W/d.sock --state-dir $W/state > $D/daemon.log 2>&1 &
DP=$!
for i in $(seq 100); do [ -S $W/d.sock ] && break; sleep 0.1; done
SPEC='import ctypes,os,sys; ctypes.CDLL(None,use_errno=True).prctl(53,0,4,0,0); os.execvp(sys.argv[1],sys.argv[1:])'
{ echo "outside: $(grep Speculation_Store /proc/self/status)"
  echo "run: $(python3 -m unisched run --socket $W/d.sock --tenant s1 --weight 100 --engines graphics,encode -- grep Speculation_Store /proc/self/status)"
  echo "run-nohooks: $(python3 -m unisched run --socket $W/d.sock --tenant s2 --weight 100 --engines graphics,encode --no-session-hooks -- grep Speculation_Store /proc/self/status)"
  echo "prctl-disable: $(python3 -c "$SPEC" grep Speculation_Store /proc/self/status)"
} > $D/ssb.txt 2>&1
cat $D/ssb.txt
P="examples/cloud_gaming.py --role instance --fps 0 --seconds 8 --warmup 4"
python3 $P --report $D/player-outside.json > $D/player-outside.log 2>&1
python3 -m unisched run --socket $W/d.sock --tenant p1 --weight 100 --engines graphics,encode -- python3 $P --report $D/player-run.json > $D/player-run.log 2>&1
python3 -m unisched run --socket $W/d.sock --tenant p2 --weight 100 --engines graphics,encode --no-session-hooks -- python3 $P --report $D/player-run-nohooks.json > $D/player-run-nohooks.log 2>&1
python3 -c "$SPEC" python3 $P --report $D/player-ssbd.json > $D/player-ssbd.log 2>&1
kill $DP; wait $DP
python3 - $D <<'PY'
import json,sys,glob,os
for f in sorted(glob.glob(sys.argv[1]+"/player-*.json")):
    r=json.load(open(f)); i=r.get("instances",[r])[0] if "instances" in r else r
    print(os.path.basename(f), {k:v for k,v in i.items() if k in ("fps_mean","encoder","cpu_cores","stages","stage_ms")} or list(i)[:30])
PY
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 500 > $D/nvml.csv 2>&1 &
NP=$!
for cfg in "1280 720 90" "640 360 140"; do set -- $cfg
  for n in 12 24; do
    echo "$(date +%s.%N) start $1x$2 it$3 N=$n" >> $D/marks.txt
    timeout 150 python3 examples/cloud_gaming.py --instances $n --weights 1,2,4 --warmup 20 --seconds 15 --width $1 --height $2 --iterations $3 \
      --out $D/cg-$1-$3-$n/players --report $D/cg-$1-$3-$n/report.json > $D/cg-$1-$3-$n.log 2>&1; echo "rc=$?" >> $D/marks.txt
    echo "$(date +%s.%N) end" >> $D/marks.txt
    python3 - $D/cg-$1-$3-$n/report.json <<'PY'
import json,sys
r=json.load(open(sys.argv[1])); print(sys.argv[1], {k:r.get(k) for k in ("fps_mean_all","fairness_min_over_max","cpu_cores_total","player_cores","host_cores")})
PY
  done
done
kill $NP
rm -rf $D/cg-*/players/*.png 2>/dev/null; du -sh $D
