#!/usr/bin/env bash
# The GPU machine's memory-enforcement tests and cost measurement in one batch (about 4 minutes on an H200):
# tests/test_gpu_memory.py (PyTorch OOM at a 4 GiB cap, EGL GL_OUT_OF_MEMORY, NVDEC over its cap, hook cost).
# Run from the project root:  source .devcache/setup.sh && bash bench/gpu_memory.sh
# Writes the pytest log and memory_hook_cost.json under $OUT (default bench/results/DATE-gpu-memory).
set -o pipefail
OUT=${OUT:-bench/results/$(date +%F)-gpu-memory}
mkdir -p "$OUT"
export UNISCHED_RESULTS=$OUT PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/clients
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
python3 -m pytest tests/test_gpu_memory.py -m gpu -s -v 2>&1 | tee "$OUT/test_gpu_memory.log"
