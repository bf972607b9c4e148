# One device call: client8+client8 variants (HEAD, longer turns, early yield), then the render fix and client240+app.
set -u
export PYTHONPATH=$PYTHONPATH:$PWD/clients
C=$1
M="python3 bench/mixed_engines.py --rounds 1 --commit $C"
keep() { mkdir -p $OUT/logs/$1; for d in /tmp/mixed-*; do for f in $d/*/daemon.log; do n=$(basename $(dirname $f)); grep -E '"lease turns"|handover' $f > $OUT/logs/$1/$n.turns 2>/dev/null; grep -cE '"lease granted"' $f > $OUT/logs/$1/$n.grants; done; done; rm -rf /tmp/mixed-*; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt
$M --out $OUT/v0-head --pairs client8+client8 --weights 1:1,3:1 > $OUT/v0.txt 2>&1; keep v0
cp unisched/policy/tuning.py /tmp/tuning.bak
sed -i 's/    handover_share: float = 0.0$/    handover_share: float = 0.005/' unisched/policy/tuning.py
grep -n "handover_share: float" unisched/policy/tuning.py >> $OUT/v1.txt
$M --out $OUT/v1-turns --pairs client8+client8 --weights 1:1,3:1 >> $OUT/v1.txt 2>&1; keep v1
cp /tmp/tuning.bak unisched/policy/tuning.py
git apply .devslim/early_yield.patch && echo applied > $OUT/v2.txt
$M --out $OUT/v2-early --pairs client8+client8 --weights 1:1,3:1 >> $OUT/v2.txt 2>&1; keep v2
git apply -R .devslim/early_yield.patch
$M --out $OUT/render --pairs frame+render --weights 3:1,1:3 > $OUT/render.txt 2>&1; keep render
$M --out $OUT/c240 --pairs client240+app --weights 1:1 > $OUT/c240.txt 2>&1; keep c240
