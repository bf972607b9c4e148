#!/usr/bin/env bash
# Memory enforcement on the GPU machine, in one batch (about 5 minutes on an H200):
#  1. bench/gpu_memory_probe.py: which RM calls PyTorch and EGL make for their memory, and how each takes a refusal
#     (NV_ERR_NO_MEMORY written into the status vs errno ENOMEM) -> $OUT/probe/{results.json,calls.jsonl,outputs.txt}
#  2. tests/test_gpu_memory.py: PyTorch OOM at a 4 GiB cap, EGL GL_OUT_OF_MEMORY, NVDEC over its cap, hook cost
#     -> $OUT/test_gpu_memory.log, $OUT/memory_hook_cost.json
# From the project root:  source .devslim/setup.sh && OUT=$OUT bash bench/gpu_memory.sh
# (six files under $OUT; default OUT: bench/results/DATE-gpu-memory)
set -o pipefail
OUT=${OUT:-bench/results/$(date +%F)-gpu-memory}
mkdir -p "$OUT/probe"
export UNISCHED_RESULTS=$OUT PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/clients
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
timeout 240 python3 bench/gpu_memory_probe.py "$OUT/probe" 2>&1 | cut -c1-2000
python3 -m pytest tests/test_gpu_memory.py -m gpu -s -v 2>&1 | tee "$OUT/test_gpu_memory.log"
