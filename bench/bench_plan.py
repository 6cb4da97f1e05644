"""How close `bulkgen plan` comes to a real `bulkgen run`, on this machine (CPU, bundled model).

For each workload (the samples, a 600-line file of short chat prompts with small max_tokens, a
1,000-line file of chat prompts answered in 8-16 tokens, a 5,000-line file of tiny completions), in one
run of this script:

- `bulkgen plan FILE --json` in its own process on a fresh storage, as a user's first plan runs: it
  measures the profile (and the start-up of `bulkgen run`) there and then;
- `bulkgen run FILE` in its own process on that storage, timed whole from outside;
- the time model alone: the simulator with that profile given each request's real output length (the
  plan's error minus the length model's).

Compared: the plan's expected seconds against the batch's generation wall time (`metrics.wall_time_s`),
the time model against the same, and the plan's start-up against the command's time outside its
generation. Goal: the plan within ±25% of the run, each workload; one verdict line each.

    python bench/bench_plan.py [--only NAME ...] [--json]

Timings are this machine's at this moment: the load average before and after is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.cli.client import detect_endpoint  # noqa: E402
from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path  # noqa: E402
from bulkgen.plan import profile as profiles  # noqa: E402
from bulkgen.plan.filework import file_work  # noqa: E402
from bulkgen.plan.timed import batch_seconds  # noqa: E402
from bulkgen.store import open_store  # noqa: E402

GOAL = 0.25  # the plan within ±25% of the run
WORDS = (
    "time year people way day thing world school state family student group country problem hand part "
    "place case week company system program question work number night point home water room mother area "
    "money story fact month book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city name team minute idea body information back parent face "
    "level office door health person art war history party result change morning reason research moment "
    "teacher force education explain write describe list tell summarize translate classify short poem "
    "about the a of and to in is for on with as"
).split()


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def synthetic(path: Path, count: int) -> Path:
    """Tiny completions: prompts of 1-5 words, max_tokens 4, greedy (requests come and go every step)."""
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(1 + i % 5))
            body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(_line(f"s-{i}", "/v1/completions", body))
    return path


def short_chat(path: Path, count: int, max_tokens: tuple[int, int] = (8, 64), seed: int = 0) -> Path:
    """Chat lines of one user message of 3-60 random words, max_tokens drawn from `max_tokens`
    (inclusive), default sampling: many short prompts, so a step's cost is its decodes' and the host's
    more than its prefill tokens'."""
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for i in range(count):
            words = rng.choice(WORDS, int(rng.integers(3, 61)))
            body = {
                "model": DEFAULT_MODEL_NAME,
                "messages": [{"role": "user", "content": " ".join(words)}],
                "max_tokens": int(rng.integers(max_tokens[0], max_tokens[1] + 1)),
            }
            f.write(_line(f"c-{i}", "/v1/chat/completions", body))
    return path


WORKLOADS = {
    "chat.jsonl": lambda d: ROOT / "samples" / "chat.jsonl",
    "completions.jsonl": lambda d: ROOT / "samples" / "completions.jsonl",
    "chat-short-600": lambda d: short_chat(d / "chat-short-600.jsonl", 600),
    "chat-8-16-1000": lambda d: short_chat(d / "chat-8-16-1000.jsonl", 1000, (8, 16), seed=1),
    "completions-5000": lambda d: synthetic(d / "completions-5000.jsonl", 5000),
}


def _cli(*args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    """A `bulkgen` command in its own process, as a user types it -> (its result, its wall seconds)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "bulkgen", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"bulkgen {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done, seconds


def run(path: Path, storage: Path) -> tuple[dict, list[int], float]:
    """`bulkgen run` in its own process, as a user runs it -> (its metrics, each request's output tokens
    in input order, the whole command's seconds). Its own process: in a test's, it would join that
    session's Ray and reuse a worker actor made with other tests' engine settings."""
    out = storage / f"{path.stem}.out.jsonl"
    _, seconds = _cli("run", str(path), "--output", str(out), "--storage", str(storage))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    lengths = [e["response"]["body"]["usage"].get("completion_tokens", 0) for e in lines]
    return json.loads(out.with_name(f"{path.stem}.out.metrics.json").read_text()), lengths, seconds


def plan(path: Path, storage: Path) -> dict:
    """`bulkgen plan --json` in its own process: the profile measured there, as on a user's first plan."""
    done, _ = _cli("plan", str(path), "--json", "--storage", str(storage))
    return json.loads(done.stdout)


def time_model(path: Path, storage: Path, lengths: list[int]) -> float:
    """The simulator with the plan's profile, given each request's real output length."""
    from transformers import AutoTokenizer

    profile = profiles.load(open_store(str(storage)), DEFAULT_MODEL_NAME, profiles.device_name())
    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    work = file_work(path, detect_endpoint(path), DEFAULT_MODEL_NAME, tokenizer, profile.max_model_len, 10**6)
    return batch_seconds(
        work.arrays(profile.prefix_caching)[1].tolist(),
        lengths,
        profile.step_seconds,
        profiles.limits_of(profile),
    )


def measure(name: str, path: Path, storage: Path) -> dict:
    planned = plan(path, storage)
    metrics, lengths, command_s = run(path, storage)
    actual = metrics["wall_time_s"]
    modelled = time_model(path, storage, lengths)
    startup = command_s - actual
    return {
        "workload": name,
        "requests": metrics["requests"],
        "actual_s": round(actual, 3),
        "plan_s": planned["estimated_seconds"]["expected"],
        "plan_ratio": round(planned["estimated_seconds"]["expected"] / actual, 3),
        "time_model_s": round(modelled, 3),
        "time_model_ratio": round(modelled / actual, 3),
        "expected_output_tokens": planned["expected_output_tokens"],
        "output_tokens": sum(lengths),
        "startup_s": round(startup, 2),
        "plan_startup_s": planned["startup_seconds"],
        "startup_ratio": round(planned["startup_seconds"] / startup, 3),
    }


def verdict(r: dict) -> str:
    """One line: what the plan said, what ran, and whether the plan is within the goal."""
    ok = abs(r["plan_ratio"] - 1) <= GOAL
    return (
        f"{'PASS' if ok else 'FAIL'} {r['workload']:<18} {r['requests']:>5} requests: generation "
        f"{r['actual_s']:.2f} s, plan {r['plan_s']:.2f} s (x{r['plan_ratio']:.2f}), time model with real "
        f"lengths {r['time_model_s']:.2f} s (x{r['time_model_ratio']:.2f}); output tokens "
        f"{r['output_tokens']:,} (plan expected {r['expected_output_tokens']:,}); start-up "
        f"{r['startup_s']:.1f} s (plan {r['plan_startup_s']:.1f} s, x{r['startup_ratio']:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), help="These workloads only.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows, load_before = [], os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or WORKLOADS:
            path = WORKLOADS[name](Path(tmp))
            row = measure(name, path, Path(tmp) / f"storage-{name}")
            rows.append(row)
            if not args.json:
                print(verdict(row), flush=True)
    load = (
        f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)"
    )
    if args.json:
        print(json.dumps({"rows": rows, "load": load}, indent=2))
    else:
        print(load)


if __name__ == "__main__":
    main()
