"""bench/gpu.py and bench/bench_sampling.py in their --quick modes, so the scripts cannot rot on CPU CI."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_gpu_bench_quick_mode_writes_its_table_and_json(tmp_path, capsys):
    gpu = _load("gpu")
    report = gpu.main(["--quick", "--out", str(tmp_path)])
    written = json.loads(next(tmp_path.glob("gpu-*-quick.json")).read_text())
    assert written == json.loads(json.dumps(report))
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"hf_static", "bulkgen_greedy", "bulkgen_sampled", "bulkgen_greedy_overlapped"}
    assert all(r["output_tokens"] == report["output_tokens"] and r["wall_s"] > 0 for r in rows.values())
    assert rows["bulkgen_greedy"]["slot_efficiency"] == 1.0 and rows["hf_static"]["slot_efficiency"] < 1.0
    assert report["greedy_vs_hf_static"]["identical_share"] == 1.0  # fp32 on CPU: token for token
    assert report["greedy_overlapped_vs_step_by_step"]["identical_share"] == 1.0
    assert report["warm_up"]["mixed_steps"] >= 1  # the timed runs' mixed-step kernels are compiled before
    assert "x static" in capsys.readouterr().out


def test_anchor_workload_is_the_issue_s():
    gpu = _load("gpu")
    a = gpu.ANCHOR
    assert (a["requests"], a["prompt"], a["output"], a["static_batch"], a["dtype"]) == (
        512,
        (16, 1024),
        (8, 256),
        64,
        "bfloat16",
    )
    assert {
        k: a["model"][k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    } == dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    assert a["model"]["tie_word_embeddings"] and a["model"]["rope_theta"] == 500000.0


def test_sampling_bench_quick_mode_reports_the_ratio():
    report = _load("bench_sampling").main(["--quick", "--json"])
    assert report["ratio"] > 0 and report["greedy_s"] > 0 and report["vocab_size"] == 32000


def test_gpu_bench_runs_from_a_checkout_without_the_package_installed(tmp_path):
    """The GPU machine has the repo but no install of bulkgen: `python bench/gpu.py` must import it from
    the checkout. `-S` skips site-packages' .pth files (the editable install); PYTHONPATH gives torch."""
    import site
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages())
    check = subprocess.run(
        [sys.executable, "-S", "-c", "import bulkgen"], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode != 0 and "No module named 'bulkgen'" in check.stderr  # really not installed
    run = subprocess.run(
        [sys.executable, "-S", str(BENCH / "gpu.py"), "--quick", "--skip-static", "--out", str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("gpu-*-quick.json")).read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == {"bulkgen_greedy", "bulkgen_sampled", "bulkgen_greedy_overlapped"}
    # each timed run starts from a cold prefix cache: the warm-up's or the greedy run's prompts are not reused
    assert (
        rows["bulkgen_greedy"]["cached_prompt_tokens"] == rows["bulkgen_sampled"]["cached_prompt_tokens"] == 0
    )


def test_gpu_probe_records_what_it_found_on_a_machine_without_cuda(tmp_path):
    report = _load("gpu_probe").main(["--out", str(tmp_path)])
    written = json.loads((tmp_path / "gpu-probe.json").read_text())
    assert written["cuda_available"] is False and report["cuda_available"] is False
    assert set(written) == {"cuda_available", "cuda_available_s"}  # the GPU phases need CUDA; none ran


def test_the_device_script_runs_each_phase_with_python3_alone(tmp_path):
    """bench/gpu_check.sh as the device runs it (no GPU here: the probe stops, the CUDA tests skip, the bench
    runs --quick), on a PATH with `python3` and no `python` (the device image names python3 only): each
    phase runs, the CUDA tests without -x, and phases.txt gets a line per phase and per bench step."""
    import shutil
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # a script, not a link: a link to a venv's python leaves the venv
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    for tool in ("bash", "timeout", "tee", "ls", "mkdir", "env"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PATH")}
    env.update(PATH=str(bin_dir), GPU_CHECK_QUICK="1")
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), str(out)],
        cwd=BENCH.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    call = run.stdout.splitlines()[0]  # the device call to make, printed first
    assert "timeout_s=600" in call  # the device's limit for one command
    printed = re.search(r"phases time out at ([\d/]+) s", call).group(1).split("/")
    # the limits printed are the ones the script sets, phase by phase, and together fit the call's
    script = (BENCH / "gpu_check.sh").read_text()
    assert printed == re.findall(r"phase [\w-]+ [\w.-]+ (\d+) ", script)
    assert sum(map(int, printed)) <= 590, printed
    phases = (out / "phases.txt").read_text().splitlines()
    top = [line.split()[:2] for line in phases if not line.startswith(" ")]
    assert top == [["probe", "rc=0"], ["cuda-tests", "rc=0"], ["gpu-bench", "rc=0"]], phases
    steps = [line.split("wall_s=")[0].split("gpu.py ")[1].strip() for line in phases if line.startswith(" ")]
    assert steps == [
        "hf_static",
        "engine setup",
        "warm-up",
        "capture",
        "bulkgen greedy",
        "bulkgen sampled",
        "bulkgen greedy, overlap flipped",
    ]
    assert "skipped" in (out / "cuda-tests.log").read_text()
    assert json.loads(next(out.glob("gpu-*-quick.json")).read_text())["warm_up"]["mixed_steps"] >= 1
    script = (BENCH / "gpu_check.sh").read_text()
    assert " -x " not in script and "$PY" in script
    limits = [int(line.split()[3]) for line in script.splitlines() if line.startswith("phase ")]
    assert len(limits) == 3 and sum(limits) <= 540  # 9 minutes of one 10-minute device call


def test_the_probe_times_each_decode_kernel_under_its_own_name(monkeypatch):
    """On CUDA the default decode kernel is triton: the padded figure must call the padded path by name."""
    import torch

    from bulkgen.engine.attention import triton_decode
    from bulkgen.engine.attention.attn_backends import DecodeMeta

    probe = _load("gpu_probe")
    called = []
    monkeypatch.setattr(triton_decode, "default_kernel", lambda device: "triton")  # as on CUDA
    monkeypatch.setattr(triton_decode, "paged_decode", lambda q, *a: called.append("triton") or q)
    q, cache = torch.randn(2, 4, 8), torch.randn(5, 4, 2, 8)
    meta = DecodeMeta(0, 2, torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 7]))
    kernels = probe.decode_kernels(q, cache, cache, meta, 0.3)
    assert set(kernels) == {"padded_decode_ms_per_layer", "triton_decode_ms_per_layer"}
    kernels["padded_decode_ms_per_layer"]()
    assert called == []
    kernels["triton_decode_ms_per_layer"]()
    assert called == ["triton"]
