#!/usr/bin/env bash
# The canary: the newest releases of the libraries bulkgen reaches into, in a scratch venv, against the
# tests that reach into them (`-m "upstream or canary"`: the architecture matrix, hybrids, the imitation checks,
# LoRA, quantized checkpoints, grammar, vision processors, a service round trip with the openai client).
# Run it before every submission; its table goes in the closing note. A package that fails is fixed, or
# pyproject.toml's upper bound stays below it with the reason said.
#
#   scripts/canary.sh [VENV]     (default: a fresh temporary folder, removed afterwards)
#
# Everything else comes from requirements/lock.txt. torch: $CANARY_TORCH, by default the newest CPU build
# pip can install here (PyPI's newer torch wheels are CUDA builds of several GB; a GPU machine sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${CANARY_TORCH:-torch==2.13.0}
NEWEST=(transformers "ray[default]" peft compressed-tensors llguidance openai fastapi)
PACKAGES=(transformers torch ray peft compressed-tensors llguidance openai fastapi)
venv=${1:-$(mktemp -d)/canary}
python -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)
# the lock without the canary's packages, so they resolve to their newest
pattern="^($(IFS='|'; echo "${PACKAGES[*]}"))=="
lock_rest=$(mktemp)
grep -Ev "$pattern" requirements/lock.txt >"$lock_rest"
"${pip[@]}" "$TORCH" -r "$lock_rest"
"${pip[@]}" --upgrade "$TORCH" "${NEWEST[@]}"
"${pip[@]}" --no-deps -e .
report=$(mktemp -d)
set +e
"$py" -m pytest -q -m "upstream or canary" -p no:cacheprovider --junitxml="$report/junit.xml" >"$report/log" 2>&1
status=$?
set -e
tail -n 3 "$report/log"
"$py" - "$report/junit.xml" "${PACKAGES[@]}" <<'PY'
"""One line a package: its version here, the lock's, and pass/fail with the first failing test of the
tests that reach into it (by the package's name in the test's path or in the failure)."""
import re
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import version

junit, packages = sys.argv[1], sys.argv[2:]
lock = dict(
    re.match(r"([A-Za-z0-9_.-]+)==([^ ;]+)", line).groups()
    for line in open("requirements/lock.txt")
    if re.match(r"[A-Za-z0-9_.-]+==", line)
)
# the tests that reach into each package, by file; a failure elsewhere whose traceback passes through the
# package's installed code counts too
REACH = {
    "transformers": (
        "test_architectures",
        "test_hybrid_models",
        "test_upstream_interfaces",
        "test_vision",
        "test_pixtral",
        "test_image_only",
    ),
    "torch": ("test_architectures", "test_hybrid_models"),
    "ray": ("test_openai_roundtrip",),
    "peft": ("test_lora",),
    "compressed-tensors": ("test_quantized_checkpoints",),
    "llguidance": ("test_grammar",),
    "openai": ("test_openai_roundtrip",),
    "fastapi": ("test_openai_roundtrip",),
}
failures = []
for case in ET.parse(junit).getroot().iter("testcase"):
    bad = case.find("failure") if case.find("failure") is not None else case.find("error")
    if bad is not None:
        failures.append((f"{case.get('classname')}::{case.get('name')}", (bad.get("message") or "") + (bad.text or "")))
for pkg in packages:
    module = pkg.replace("-", "_")
    mine = [
        name for name, text in failures
        if any(f in name for f in REACH.get(pkg, ())) or f"site-packages/{module}/" in text
    ]
    result = "pass" if not mine else f"FAIL first: {mine[0]}"
    print(f"canary {pkg} {version(pkg)} (lock {lock.get(pkg, 'not pinned')}): {result}")
print(f"canary total: {len(failures)} failing tests")
PY
[ -z "${1:-}" ] && rm -rf "$(dirname "$venv")"
exit $status
