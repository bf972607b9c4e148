#!/usr/bin/env bash
# `unisched calibrate` on the GPU machine: the gpu test of --quick (tests/test_gpu_calibrate.py, about 45 s), then a
# standard calibration (10 s windows, about 65 s) written to $OUT/contention.json with its workloads' logs, and the
# daemon's reader on it. About 2.5 minutes in all.
# Run: source .devcache/setup.sh && bash bench/h200_calibrate.sh   (carry .devcache; results under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_gpu_calibrate.py 2>&1 | tee "$OUT/pytest-calibrate.log" | tail -30
timeout 200 python3 -m unisched calibrate --out "$OUT/contention.json" --work-dir "$OUT/calibrate-work" 2>&1 \
  | tee "$OUT/calibrate.log"
python3 - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/calibrate.log"
import json, sys
from pathlib import Path
from unisched.scheduler.state import StateStore
out = Path(sys.argv[1])
for gpu in json.loads((out / "contention.json").read_text())["gpus"]:
    print("daemon reads", gpu, StateStore(out).measured_contention(gpu))
PY
