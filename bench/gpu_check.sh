#!/usr/bin/env bash
# The device run for a session lent a GPU: one call, under 9 minutes, every phase writing under $1
# (default $OUT) as it goes, so a crash or a timeout keeps what ran before it; phases.txt gets one line per
# phase (and per bench/gpu.py step) with its wall seconds, so a timeout shows where the time went.
#   run: bash bench/gpu_check.sh "$OUT"        (from the repo root; installs nothing)
# Then copy $OUT/gpu-*.json, gpu-probe.json and gpu-decode-tiles.json into bench/results/ with the date, and commit them.
# GPU_CHECK_QUICK=1 runs bench/gpu.py --quick (the CPU test of this script); PYTHON picks the interpreter.
set -u
out="${1:-${OUT:?give the output folder}}"
PY="${PYTHON:-python3}"  # the device image names python3 only
echo "device call: run(command='bash bench/gpu_check.sh \"\$OUT\"', timeout_s=600) - no carry; phases time out at 120/170/190/110 s"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPU_CHECK_PHASES="$out/phases.txt"
: > "$out/phases.txt"
phase() {  # phase NAME LOG TIMEOUT CMD...: run it, tee its output to LOG, append "NAME rc wall_s" to phases.txt
    local name=$1 log=$2 limit=$3 started=$SECONDS rc
    shift 3
    timeout "$limit" "$@" 2>&1 | tee "$out/$log"
    rc=${PIPESTATUS[0]}
    echo "$name rc=$rc wall_s=$((SECONDS - started))" | tee -a "$out/phases.txt"
}
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$out/nvidia-smi.csv" 2>&1
phase probe probe.log 120 "$PY" bench/gpu_probe.py --out "$out"
# no -x: one failing test must not cost the ones after it
# every CUDA test module (tests/engine/*_cuda.py): the engine's paths, online FP8 and the FP8 KV cache; a
# test needing a package the image lacks (compressed-tensors) fails alone and says so in the log
phase cuda-tests cuda-tests.log 170 "$PY" -m pytest -q -p no:cacheprovider -s tests/engine/*_cuda.py
phase gpu-bench gpu-bench.log 190 "$PY" bench/gpu.py --out "$out" ${GPU_CHECK_QUICK:+--quick}
# the paged decode kernel's launch choices against its defaults (tiles of rows per iteration, warps, splits)
[ -n "${GPU_CHECK_QUICK:-}" ] || phase decode-tiles decode-tiles.log 110 "$PY" bench/gpu_decode_tiles.py --out "$out" --budget-s 80
ls -l "$out"
