"""The time model (profile + simulator) against real `bulkgen run`s: the samples and a 5,000-line file,
CPU, bundled model.

What is compared: the estimate against the finished batch's `metrics.wall_time_s` (first request into the
engine -> last one out), the part of a run the plan models; start-up (Ray, the worker, the model load) is
reported apart. On a busy 2-core machine step times swing with whatever else runs, so a profile is measured
right before each run and once after the last, and the 5,000-line run must land within ±25% of the
estimate made with the profile before it or the one after it (or between them); the sub-second samples
within a factor of 2.5 (see SHORT_FACTOR). Each file runs on its own storage, so no runtime factor applies
(bulkgen/plan/calibrate.py needs earlier batches of 5 s or more). The simulator is given each request's
real output length (from the output file), so this checks the time model; the length model's own error is
documented in docs/plan.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path
from bulkgen.plan import profile as profiles
from bulkgen.plan.scan import scan_file
from bulkgen.sim.timed import EngineLimits, batch_seconds

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
TOLERANCE = 0.25
# The samples run for under a second. There the engine alone matches the model (chat run straight on the
# engine with the worker's request preparation: 0.44-0.46 s in 33 steps, simulated 0.43 s in 33 steps), but
# inside `bulkgen run` on a busy 2-core machine the same steps ran 0.9-2.1x the estimate from run to run
# (the driver validating, indexing and publishing on the cores the engine's two threads use). So batches
# under SHORT_S are held to a factor of SHORT_FACTOR only; docs/plan.md gives the figures.
SHORT_S, SHORT_FACTOR = 5.0, 2.5


def synthetic(path: Path, count: int = 5000) -> Path:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 5))
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(json.dumps({"custom_id": f"s-{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def run_batch(path: Path, storage: Path) -> dict:
    """`bulkgen run` in its own process, as a user runs it: in this one it would join the test session's
    Ray and reuse a worker actor made with other tests' engine settings, which the profile does not model."""
    out = storage / f"{path.stem}.out.jsonl"
    cmd = [sys.executable, "-c", "from bulkgen.cli import cli; cli()", "run", str(path), "--output", str(out),
           "--storage", str(storage)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(out.with_name(f"{path.stem}.out.metrics.json").read_text())


def real_lengths(storage: Path, path: Path, requests: int) -> list[int]:
    """Each request's completion tokens, in input order (the output file keeps it)."""
    lines = [json.loads(line) for line in (storage / f"{path.stem}.out.jsonl").read_text().splitlines()]
    assert len(lines) == requests
    return [e["response"]["body"]["usage"].get("completion_tokens", 0) for e in lines]


def engine_seconds(work, outputs: list[int], profile: profiles.Profile) -> float:
    limits = EngineLimits(profile.max_num_seqs, profile.max_num_batched_tokens)
    return batch_seconds(work.arrays()[1].tolist(), outputs, profile.step_seconds, limits)


def test_estimate_lands_within_25_percent_of_the_run(tmp_path):
    from transformers import AutoTokenizer

    from bulkgen.client import detect_endpoint

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    files = [SAMPLES / "chat.jsonl", SAMPLES / "completions.jsonl", synthetic(tmp_path / "synthetic.jsonl")]
    measured, actual = [], {}
    for f in files:  # a profile right before each run, and one after the last: the machine's speed then
        measured.append(profiles.measure(DEFAULT_MODEL_NAME, default_model_path()))
        actual[f.name] = run_batch(f, tmp_path / f.stem)  # each on its own storage: no runtime factor yet
    measured.append(profiles.measure(DEFAULT_MODEL_NAME, default_model_path()))
    report = {}
    for i, f in enumerate(files):
        work = scan_file(f, detect_endpoint(f), DEFAULT_MODEL_NAME, tokenizer, measured[0].max_model_len, 50_000)
        assert sum(work.prompt_tokens) == actual[f.name]["input_tokens"]  # exact, as the workers counted
        outputs = real_lengths(tmp_path / f.stem, f, work.validation.total)
        low, high = sorted(engine_seconds(work, outputs, p) for p in measured[i:i + 2])
        report[f.name] = {"actual": actual[f.name]["wall_time_s"], "estimate": [round(low, 3), round(high, 3)]}
    print(json.dumps(report))
    for name, r in report.items():
        low, high = r["estimate"]
        if r["actual"] < SHORT_S:
            assert low / SHORT_FACTOR <= r["actual"] <= high * SHORT_FACTOR, (name, report)
        else:
            assert low * (1 - TOLERANCE) <= r["actual"] <= high * (1 + TOLERANCE), (name, report)
