#!/usr/bin/env bash
# Re-resolve the two locks from pyproject.toml's ranges with uv (never edit them by hand). A bump: raise
# the range in pyproject.toml, run this, run the suite (README) and scripts/canary.sh, commit.
#   requirements/lock.txt         the newest releases in range: what README's install and CI use
#   requirements/lower-bound.txt  the same with requirements/lower-bound.in's releases (the GPU image's)
# Both are pip constraints files (`pip install -c requirements/lock.txt ...`), universal across Pythons
# and platforms. torch is left out: README pins the CPU build, a GPU machine keeps its own CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null || python -m pip install -q "uv==0.13.9"
# the CPU torch wheel, where the machine carries one, keeps CUDA's packages out of the resolution
links=()
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)
common=(pyproject.toml --extra test --extra docs --extra fp8 --universal --no-emit-package torch
    --no-header --annotation-style line "${links[@]}")
uv pip compile "${common[@]}" -o requirements/lock.txt
uv pip compile "${common[@]}" --override requirements/lower-bound.in -o requirements/lower-bound.txt
echo "locked: $(grep -c '==' requirements/lock.txt) pins in requirements/lock.txt, $(grep -c '==' requirements/lower-bound.txt) in requirements/lower-bound.txt"
