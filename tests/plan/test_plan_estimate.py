"""`bulkgen plan`'s estimate against real `bulkgen run`s of the samples and a 5,000-line file (CPU, bundled model).

What is compared: the estimate's `expected` seconds against the finished batch's `metrics.wall_time_s`
(first request into the engine -> last one out), the part of a run the plan models; start-up (Ray, the
worker, the model load) is reported apart. On a shared 2-core machine step times swing with whatever
else runs, so the profile is measured twice in this test, right before and right after the runs, and
each run must land within ±25% of the estimate made with one of the two profiles (or between them).
Each file runs in its own storage, so its length model is the measured share of that same batch: this
test checks the time model (profile + simulator), not the length guess.
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from bulkgen.batch.records import BatchRepo
from bulkgen.cli import cli
from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path
from bulkgen.plan import lengths, planner
from bulkgen.plan import profile as profiles
from bulkgen.store import open_store

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
TOLERANCE = 0.25


def synthetic(path: Path, count: int = 5000) -> Path:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 5))
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(json.dumps({"custom_id": f"s-{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def run_batch(path: Path, storage: Path) -> dict:
    out = storage / "out.jsonl"
    result = CliRunner().invoke(cli, ["run", str(path), "--output", str(out), "--storage", str(storage)])
    assert result.exit_code == 0, result.output
    return json.loads((storage / "out.metrics.json").read_text())


def plan(path: Path, storage: Path, profile: profiles.Profile, tokenizer) -> dict:
    from bulkgen.client import detect_endpoint

    history = lengths.from_history(BatchRepo(open_store(str(storage))), DEFAULT_MODEL_NAME)
    return planner.plan_file(path, detect_endpoint(path), DEFAULT_MODEL_NAME, default_model_path(), tokenizer,
                             history, 1, 50_000, profile=profile)


def test_estimate_lands_within_25_percent_of_the_run(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    files = [SAMPLES / "chat.jsonl", SAMPLES / "completions.jsonl", synthetic(tmp_path / "synthetic.jsonl")]
    before = profiles.measure(DEFAULT_MODEL_NAME, default_model_path())
    actual = {f.name: run_batch(f, tmp_path / f.stem) for f in files}
    after = profiles.measure(DEFAULT_MODEL_NAME, default_model_path())
    report = {}
    for f in files:
        plans = [plan(f, tmp_path / f.stem, p, tokenizer) for p in (before, after)]
        low, high = sorted(p["estimated_seconds"]["expected"] for p in plans)
        report[f.name] = (actual[f.name]["wall_time_s"], low, high)
        assert plans[0]["prompt_tokens"] == actual[f.name]["input_tokens"]  # exact, as the workers counted
        assert abs(plans[0]["expected_output_tokens"] - actual[f.name]["output_tokens"]) <= plans[0]["requests"]
    print(json.dumps(report))
    for name, (real, low, high) in report.items():
        assert low * (1 - TOLERANCE) <= real <= high * (1 + TOLERANCE), (name, real, low, high, report)
