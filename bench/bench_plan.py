"""How close the plan's time comes to a real `bulkgen run`, on this machine (CPU, bundled model).

For each file (the samples and a synthetic 5,000-line file): a throughput profile measured just before
the run (`bulkgen profile`'s measurement), the run itself (`bulkgen run` in its own process, on its own
storage), and the simulator's time for the file given each request's real output length, so this measures
the time model (the length model's own error is in docs/plan.md). Compared: the batch's generation wall
time (`metrics.wall_time_s`); start-up is not part of it. Goal: within ±25%.

    python bench/bench_plan.py [--lines 5000] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.cli.client import detect_endpoint  # noqa: E402
from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402
from bulkgen.plan import profile as profiles  # noqa: E402
from bulkgen.plan.scan import scan_file  # noqa: E402
from bulkgen.plan.timed import EngineLimits, batch_seconds  # noqa: E402


def synthetic(path: Path, count: int) -> Path:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 5))
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(
                json.dumps({"custom_id": f"s-{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    return path


def run(path: Path, storage: Path) -> tuple[dict, list[int]]:
    """`bulkgen run` in its own process, as a user runs it -> (its metrics, each request's output tokens in
    input order). Its own process: in a test's, it would join that session's Ray and reuse a worker actor
    made with other tests' engine settings, which the profile does not model."""
    out = storage / f"{path.stem}.out.jsonl"
    cmd = [
        sys.executable,
        "-c",
        "from bulkgen.cli import cli; cli()",
        "run",
        str(path),
        "--output",
        str(out),
        "--storage",
        str(storage),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"bulkgen run {path} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [e["response"]["body"]["usage"].get("completion_tokens", 0) for e in lines]
    return json.loads(out.with_name(f"{path.stem}.out.metrics.json").read_text()), lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    from bulkgen.engine.engine import _max_model_len

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    context = _max_model_len(AutoConfig.from_pretrained(default_model_path(), local_files_only=True), None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [
            ROOT / "samples" / "chat.jsonl",
            ROOT / "samples" / "completions.jsonl",
            synthetic(Path(tmp) / "synthetic.jsonl", args.lines),
        ]
        for f in files:
            profile = profiles.measure(DEFAULT_MODEL_NAME, default_model_path())
            metrics, lengths = run(f, Path(tmp) / f.stem)
            work = scan_file(f, detect_endpoint(f), DEFAULT_MODEL_NAME, tokenizer, context, 1_000_000)
            limits = EngineLimits(profile.max_num_seqs, profile.max_num_batched_tokens)
            estimate = batch_seconds(work.arrays()[1].tolist(), lengths, profile.step_seconds, limits)
            rows.append(
                {
                    "file": f.name,
                    "requests": metrics["requests"],
                    "actual_s": metrics["wall_time_s"],
                    "estimate_s": round(estimate, 3),
                    "ratio": round(metrics["wall_time_s"] / estimate, 3),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        ok = "within" if abs(r["ratio"] - 1) <= 0.25 else "OUTSIDE"
        print(
            f"{r['file']:<20} {r['requests']:>6} requests  actual {r['actual_s']:7.2f} s  estimate "
            f"{r['estimate_s']:7.2f} s  actual/estimate {r['ratio']:.2f}  ({ok} ±25%)"
        )


if __name__ == "__main__":
    main()
