#!/usr/bin/env bash
# One device call: everything the GPU machine is needed for, results under $OUT.
#   run: source .devcache/setup.sh && bash bench/gpu_session.sh   (carry: [".devcache"])
# Steps (STEPS, comma-separated; each logged): probe (NVML sampling, Python modules), tests (GPU tests on this
# machine's real cgroup v2), usertests (examples and client tests), rtt (lease round trip), coop (cooperative
# pairs: bench/gpu_pairs.py --engine user, COOP_ARGS), pairs (kernel-engine pairs, PAIRS_ARGS), hooks (session hook tests and start-up cost),
# scenarios (bench/scenarios.py --scenarios $SCEN, SCEN_ARGS; into $OUT/scenarios, merged with SCEN_PREV if given).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ date -u; hostname; uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader;
  python3 -c 'import grpc, google.protobuf as p, structlog; print("grpc", grpc.__version__, "protobuf", p.__version__)';
  mount | grep cgroup; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step=${STEPS:-tests,pairs}
has() { [[ ",$step," == *",$1,"* ]]; }
if has probe; then
  echo "== nvml probe"; timeout 60 python3 bench/nvml_probe.py --seconds 5 --json "$OUT/nvml_probe.json" 2>&1 | tail -12
fi
if has tests; then
  echo "== tests"; timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_daemon_cgroups.py tests/test_cli_errors.py tests/test_grpc.py tests/test_engine.py 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if has probe; then
  echo "== python modules"; python3 - <<'PY' 2>&1 | tee "$OUT/modules.txt"
import importlib
for m in ("torch", "torchvision", "pycuda", "OpenGL", "av", "structlog", "grpc"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
try:
    import av; print("h264 encoders:", [c for c in ("libx264", "libopenh264", "h264_nvenc") if c in av.codecs_available])
except Exception as e:
    print("av codecs:", e)
PY
fi
if has usertests; then
  echo "== user engine tests"; timeout 420 python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_examples_gpu.py tests/test_gpu_hooks.py tests/test_client.py tests/test_leases.py 2>&1 | tee "$OUT/pytest-user.log" | grep -E "passed|failed|FAILED|SKIPPED|Error|^0[1-5]_|decode with|render with" | tail -40
fi
if has hooks; then
  echo "== kernel hooks on the real driver"; timeout 300 python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu_hooks.py 2>&1 | tee "$OUT/pytest-hooks.log" | tail -15
  timeout 240 python3 bench/hook_startup.py --out "$OUT/hook-startup" 2>&1 | tail -6
fi
if has rtt; then
  echo "== lease rtt"; timeout 120 python3 bench/lease_load.py --tenants 1 --seconds 20 --warmup 3 --renew-ms 25 --out "$OUT/lease-rtt" 2>&1 | tail -4
fi
if has coop; then
  echo "== cooperative pairs"
  python3 bench/gpu_pairs.py --engine user --overhead --out "$OUT/coop-pairs" ${DRY:-} \
    --workload-cmd-cuda "${COOP_CUDA:-python3 examples/02_pytorch_training.py --model resnet50}" \
    --workload-cmd-render "${COOP_RENDER:-python3 examples/03_egl_render.py}" \
    --render-iterations 447 ${COOP_ARGS:-} 2>&1 | tee "$OUT/coop_pairs.log" | tail -40
fi
if has pairs; then
  echo "== gpu pairs"; python3 bench/gpu_pairs.py --out "$OUT/pairs" ${PAIRS_ARGS:-} 2>&1 | tee "$OUT/gpu_pairs.log" | tail -40
fi
if has scenarios; then
  echo "== scenarios ${SCEN:-all}"
  mkdir -p "$OUT/scenarios"
  [ -n "${SCEN_PREV:-}" ] && cp "$SCEN_PREV"/results.json "$OUT/scenarios/" 2>/dev/null
  python3 bench/scenarios.py --out "$OUT/scenarios" --work-dir /tmp/scen-work ${SCEN:+--scenarios $SCEN} ${SCEN_ARGS:-} 2>&1 | tee "$OUT/scenarios.log" | tail -45
  # one archive (what comes back is limited in count): the last 300 kB of every log and every raw report
  rm -rf /tmp/scen-logs; mkdir -p /tmp/scen-logs
  find /tmp/scen-work \( -name "*.log" -o -name "*.json" \) | while read -r f; do tail -c 300000 "$f" > "/tmp/scen-logs/$(echo "${f#/tmp/scen-work/}" | tr / _)"; done
  tar czf "$OUT/scenario-logs.tgz" -C /tmp/scen-logs .
fi
