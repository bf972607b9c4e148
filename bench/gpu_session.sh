#!/usr/bin/env bash
# One device call: everything the GPU machine is needed for, results under $OUT.
#   run: source .devcache/setup.sh && bash bench/gpu_session.sh   (carry: [".devcache"])
# Steps (each logged): machine facts, NVML sampling probe, the whole test suite (GPU tests included) on this
# machine's real cgroup v2, then bench/gpu_pairs.py.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ date -u; hostname; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c 'import grpc, google.protobuf as p, structlog; print("grpc", grpc.__version__, "protobuf", p.__version__)';
  mount | grep cgroup; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step=${STEPS:-tests,pairs}
if [[ $step == *probe* ]]; then
  echo "== nvml probe"; timeout 60 python3 bench/nvml_probe.py --seconds 5 --json "$OUT/nvml_probe.json" 2>&1 | tail -12
fi
if [[ $step == *tests* ]]; then
  echo "== tests"; timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_daemon_cgroups.py tests/test_cli_errors.py tests/test_grpc.py tests/test_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [[ $step == *pairs* ]]; then
  echo "== gpu pairs"; python3 bench/gpu_pairs.py --out "$OUT/pairs" ${PAIRS_ARGS:-} 2>&1 | tee "$OUT/gpu_pairs.log" | tail -40
fi
