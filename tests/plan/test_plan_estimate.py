"""The plan's time model against real `bulkgen run`s, without a clock: the samples and a 5,000-line file,
CPU, bundled model.

A unit test may not depend on how fast this machine is (timing goals live in bench/), so this checks what
makes an estimate right on any machine: the plan counts each file's prompt tokens exactly as the workers
did, and the simulator, given each request's real output length, takes the number of engine steps the
run's engine really took (a unit cost per step turns its seconds into steps). How close the seconds come,
with a profile measured on the machine, is `python bench/bench_plan.py` (figures in docs/plan.md).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path
from bulkgen.plan.filework import file_work
from bulkgen.plan.timed import EngineLimits, batch_seconds

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
STEP_TOLERANCE = (
    0.10  # the engine admits by KV blocks and prefill chunks; the simulator by token budget alone
)


def _bench():
    """bench/bench_plan.py: the test and the figures use one workload and one way to run it."""
    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "bench" / "bench_plan.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def simulated_steps(work, outputs: list[int]) -> float:
    from bulkgen.engine.config import EngineConfig, resolve_limits

    config = resolve_limits(EngineConfig(), torch.device("cpu"))  # what `bulkgen run` uses here
    limits = EngineLimits(config.max_num_seqs, config.max_num_batched_tokens)
    return batch_seconds(work.arrays()[1].tolist(), outputs, lambda *_: 1.0, limits)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """`bulkgen run` of samples/chat.jsonl on its own storage, once for both tests: (metrics, each request's
    output tokens, the command's seconds)."""
    return _bench().run(SAMPLES / "chat.jsonl", tmp_path_factory.mktemp("chat-run"))


@pytest.mark.subprocess  # `bulkgen run` and the profile, as processes
def test_plan_counts_tokens_exactly_and_simulates_the_steps_the_engine_took(tmp_path, chat_run):
    from transformers import AutoConfig, AutoTokenizer

    from bulkgen.cli.client import detect_endpoint
    from bulkgen.engine.engine import _max_model_len  # the engine's own context rule, as plan uses it

    tokenizer = AutoTokenizer.from_pretrained(default_model_path(), local_files_only=True)
    context = _max_model_len(AutoConfig.from_pretrained(default_model_path(), local_files_only=True), None)
    bench = _bench()
    files = [
        SAMPLES / "chat.jsonl",
        SAMPLES / "completions.jsonl",
        bench.synthetic(tmp_path / "synthetic.jsonl", 5000),
    ]
    report = {}
    for f in files:
        metrics, lengths, _ = (
            chat_run if f.name == "chat.jsonl" else bench.run(f, tmp_path / f.stem)
        )  # each on its own storage
        work = file_work(f, detect_endpoint(f), DEFAULT_MODEL_NAME, tokenizer, context, 50_000)
        assert sum(work.prompt_tokens) == metrics["input_tokens"]  # exact, as the workers counted
        assert len(lengths) == work.validation.total
        steps = sum(w["steps"] for w in metrics["per_worker"].values())
        report[f.name] = {"engine_steps": steps, "simulated": simulated_steps(work, lengths)}
    print(json.dumps(report))
    for name, r in report.items():
        assert abs(r["simulated"] - r["engine_steps"]) <= STEP_TOLERANCE * r["engine_steps"] + 1, (
            name,
            report,
        )


@pytest.mark.subprocess  # `bulkgen run` and the profile, as processes
def test_plan_tells_the_start_up_a_fresh_run_adds(tmp_path, chat_run):
    """A user times the whole `bulkgen run`: the plan's start-up must be what the command spends beside
    its generation (Ray, the worker, the model load, the results), not the model load alone (0.2-0.5 s
    of the 15-30 s here). Generous: the two are measured a minute apart on a shared machine."""
    bench = _bench()
    planned = bench.plan(SAMPLES / "chat.jsonl", tmp_path)  # measures the profile, as a first plan does
    metrics, _, command_s = chat_run  # a fresh run of the same file, on storage of its own
    spent = command_s - metrics["wall_time_s"]
    assert planned["model_load_seconds"] < planned["startup_seconds"]
    assert spent / 2.5 <= planned["startup_seconds"] <= spent * 2.5, (planned["startup_seconds"], spent)
