#!/usr/bin/env bash
# The device run for a session lent a GPU: one call, under 9 minutes, every phase writing under $1
# (default $OUT) as it goes, so a crash or a timeout keeps what ran before it.
#   run: bash bench/gpu_check.sh "$OUT"        (from the repo root; installs nothing)
# Then copy $OUT/gpu-*.json and gpu-probe.json into bench/results/ with the date, and commit them.
set -u
out="${1:-${OUT:?give the output folder}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$out/nvidia-smi.csv" 2>&1
timeout 150 python bench/gpu_probe.py --out "$out" 2>&1 | tee "$out/probe.log"
timeout 170 python -m pytest -q -x -p no:cacheprovider -s tests/engine/test_engine_cuda.py 2>&1 | tee "$out/cuda-tests.log"
timeout 200 python bench/gpu.py --out "$out" 2>&1 | tee "$out/gpu-bench.log"
ls -l "$out"
