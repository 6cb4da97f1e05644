"""The device run (bench/gpu_check.sh) goes to a GPU image that has torch, transformers and triton but none
of the service's packages (the device tool's KINDS.md): its CUDA test modules, the test harness around them
(tests/conftest.py and its fast-tier guard) and bench/gpu.py must run with those packages missing. On CPU
the CUDA tests skip, so what this checks is that nothing on the way imports what the image lacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# listed by the device tool as absent from the GPU image (or only a service's, never the engine's)
ABSENT = (
    "ray",
    "fastapi",
    "starlette",
    "uvicorn",
    "llguidance",
    "boto3",
    "botocore",
    "moto",
    "tenacity",
    "openai",
)

# None in sys.modules: `import ray` raises ModuleNotFoundError and importlib.util.find_spec("ray") answers
# None, as where the package is not installed (transformers probes optional packages that way)
SITECUSTOMIZE = f"""
import sys
sys.modules.update(dict.fromkeys({ABSENT!r}))
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )


def test_the_absent_packages_are_really_absent_in_the_child(tmp_path):
    done = _run(tmp_path, "-c", "import ray")
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr


@pytest.mark.slow
def test_cuda_test_modules_run_without_the_service_packages(tmp_path):
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/engine").glob("*_cuda.py"))
    assert modules
    done = _run(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules)
    # every CUDA test skips on CPU; an import error or INTERNALERROR in the harness gives rc 3 or 4
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "INTERNALERROR" not in done.stdout and " error" not in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_gpu_bench_quick_mode_runs_without_the_service_packages(tmp_path):
    done = _run(tmp_path, "bench/gpu.py", "--quick", "--skip-static", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert list((tmp_path / "out").glob("gpu-*-quick.json"))
