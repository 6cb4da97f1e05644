"""jobs/train_tiny.py end to end on a budget of seconds: loss goes down, the output loads everywhere."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bulkgen.lab.memory import LLAMA_3_2_1B, LLAMA_3_8B, MemoryRow

JOB = Path(__file__).resolve().parents[2] / "jobs" / "train_tiny.py"
TINY = [
    "--steps",
    "12",
    "--minutes",
    "3",
    "--batch",
    "4",
    "--context",
    "64",
    "--hidden",
    "32",
    "--intermediate",
    "64",
    "--layers",
    "1",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--vocab",
    "512",
    "--lr",
    "1e-2",
    "--eval-every",
    "0",
    "--memory-context",
    "2048",
    "--memory-batch",
    "8",
]


def _job():
    spec = importlib.util.spec_from_file_location("train_tiny", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    return out, _job().main(["--out", str(out), *TINY])


def test_loss_goes_down_and_the_summary_says_so(trained, capsys):
    out, summary = trained
    assert summary["steps"] == 12 and summary["stopped_by"] == "steps"
    assert summary["last_loss"] < summary["first_loss"]
    assert summary["heldout_loss"] < summary["untrained_heldout_loss"]
    assert json.loads((out / "training_summary.json").read_text())["heldout_loss"] == summary["heldout_loss"]
    assert "Llama-3-8B" in (out / "README.md").read_text()


def test_output_loads_with_transformers_and_the_engine(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bulkgen.engine import Engine, SamplingParams

    out, summary = trained
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.vocab_size == len(tok) == summary["vocab_size"]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert (
        tok.decode(tok("Any text, even ünïcode ✓")["input_ids"]) == "Any text, even ünïcode ✓"
    )  # byte-level
    engine = Engine.from_pretrained(str(out), max_num_seqs=2, max_num_batched_tokens=256)
    assert (
        len(engine.generate(["The list is"], SamplingParams(max_tokens=4, temperature=0))[0].token_ids) >= 1
    )


def test_memory_arithmetic_matches_the_published_shapes():
    assert LLAMA_3_2_1B.parameters == 1_235_814_400  # the published Llama-3.2-1B count
    assert LLAMA_3_8B.parameters == 8_030_261_248  # the published Llama-3-8B count
    row = MemoryRow(LLAMA_3_8B, context=4096, batch=16)
    assert row.kv_cache_bytes == 2 * 32 * 8 * 128 * 2 * 4096 * 16  # K and V, layers, KV heads, head dim, bf16
    assert row.training_bytes == 16 * LLAMA_3_8B.parameters
