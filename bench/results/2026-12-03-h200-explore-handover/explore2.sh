# Device call: client8+client8 with longer turns / start grace / both (debug logs kept), and frame+render logs.
set -u
export PYTHONPATH=$PYTHONPATH:$PWD/clients
C=$1
M="python3 bench/mixed_engines.py --rounds 1 --commit $C --serve-arg=--log-level --serve-arg=debug"
keep() { (cd /tmp && tar czf $OUT/logs-$1.tgz --exclude='*.sock*' --exclude=state mixed-*); rm -rf /tmp/mixed-*; }
share() { sed -i "s/    handover_share: float = .*/    handover_share: float = $1/" unisched/policy/tuning.py; }
share 0.005
$M --out $OUT/v1-turns --pairs client8+client8 --weights 1:1,3:1 > $OUT/v1.txt 2>&1; keep v1
share 0.0
git apply .devslim/grace.patch && echo applied > $OUT/v3.txt
$M --out $OUT/v3-grace --pairs client8+client8 --weights 1:1,3:1 >> $OUT/v3.txt 2>&1; keep v3
share 0.005
$M --out $OUT/v4-both --pairs client8+client8 --weights 1:1,3:1 > $OUT/v4.txt 2>&1; keep v4
share 0.0
git apply -R .devslim/grace.patch
$M --out $OUT/render --pairs frame+render --weights 3:1,1:3 > $OUT/render.txt 2>&1; keep render
grep -h "normalized" $OUT/*.txt
