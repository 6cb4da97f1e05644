"""The bundled default model: shipped in the package, found by default, and writes English."""

from __future__ import annotations

import json

import pytest

from bulkgen.models.registry import BUNDLED_MODEL, DEFAULT_MODEL_NAME, default_model_path, parse_model_specs
from tests.models.english import looks_like_english

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
    "training_summary.json",
]


def test_bundled_model_is_the_default(monkeypatch):
    monkeypatch.delenv("BULKGEN_DEFAULT_MODEL", raising=False)
    assert parse_model_specs([]) == {DEFAULT_MODEL_NAME: str(BUNDLED_MODEL)}
    monkeypatch.setenv("BULKGEN_DEFAULT_MODEL", "/elsewhere")
    assert default_model_path() == "/elsewhere"


def test_bundled_model_files_are_small_and_complete():
    for name in FILES:
        assert (BUNDLED_MODEL / name).is_file(), name
    assert (BUNDLED_MODEL / "model.safetensors").stat().st_size < 12 * 2**20
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["model_type"] == "llama" and 2048 <= config["vocab_size"] <= 8192
    assert config["max_position_embeddings"] >= 512 and config["eos_token_id"] is not None


def test_training_beat_the_unigram_baseline():
    summary = json.loads((BUNDLED_MODEL / "training_summary.json").read_text())
    assert (
        summary["heldout_loss_bf16"] < summary["unigram_baseline"] - 1.0
    )  # nats/token, same tokenizer and split


@pytest.fixture(scope="module")
def engine():
    from bulkgen.engine import Engine

    return Engine.from_pretrained(str(BUNDLED_MODEL), max_num_seqs=8, max_num_batched_tokens=1024)


def _chat_ids(tok, content: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def test_chat_answers_read_as_english_and_stop(engine):
    from bulkgen.engine import SamplingParams

    prompts = [
        "Tell me about lists.",
        "What is a module?",
        "Label this feedback: the app crashes on start.",
        "Write a haiku about a GPU running overnight.",
    ]
    ids = [_chat_ids(engine.tokenizer, p) for p in prompts]
    greedy = engine.generate(ids, [SamplingParams(max_tokens=200, temperature=0)] * len(ids))
    sampled = engine.generate(
        ids, [SamplingParams(max_tokens=200, temperature=0.8, top_p=0.95, seed=i) for i in range(len(ids))]
    )
    outputs = greedy + sampled
    assert all(looks_like_english(o.text) for o in outputs), [o.text for o in outputs]
    assert sum(o.finish_reason == "stop" for o in outputs) >= len(outputs) // 2  # it learned to emit <|end|>


def test_plain_completion_reads_as_english(engine):
    from bulkgen.engine import SamplingParams

    out = engine.generate(
        ["The list is", "A function is"], [SamplingParams(max_tokens=30, temperature=0)] * 2
    )
    assert all(looks_like_english(o.text) for o in out), [o.text for o in out]


def test_bundled_template_is_the_one_the_model_was_trained_with_and_renders_tools():
    """jobs/train_tiny.py writes bulkgen.lab.tiny.CHAT_TEMPLATE; the shipped copy must be that one, and
    without tools it must render as the template the weights were trained on (no tools block)."""
    from transformers import AutoTokenizer

    from bulkgen.batch.tools import tool_format
    from bulkgen.lab.tiny import CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL, local_files_only=True)
    assert tok.chat_template == CHAT_TEMPLATE and tool_format(CHAT_TEMPLATE) == "hermes"
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}]
    assert (
        tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        == "<|system|>\nbe brief<|end|>\n<|user|>\nhi\nthere<|end|>\n<|assistant|>\n"
    )


@pytest.mark.slow  # `bulkgen run` in its own process: Ray, a worker
def test_tool_sample_runs_with_every_forced_call_valid_for_its_schema(tmp_path):
    """samples/tools.jsonl through `bulkgen run` (its own process, as a user runs it): every line answers
    a call of an allowed function whose arguments parse and validate against that function's schema."""
    import subprocess
    import sys
    from pathlib import Path

    import jsonschema

    sample = Path(__file__).resolve().parents[2] / "samples" / "tools.jsonl"
    out = tmp_path / "tools.out.jsonl"
    command = [sys.executable, "-m", "bulkgen", "run", str(sample), "-o", str(out)]
    done = subprocess.run(
        command + ["--storage", str(tmp_path / "storage")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    requests = {r["custom_id"]: r["body"] for r in map(json.loads, sample.read_text().splitlines())}
    answers = {a["custom_id"]: a["response"] for a in map(json.loads, out.read_text().splitlines())}
    assert set(answers) == set(requests)
    for custom_id, body in requests.items():
        assert answers[custom_id]["status_code"] == 200, answers[custom_id]
        choice = answers[custom_id]["body"]["choices"][0]
        if "tools" in body:  # tool_choice "required" or {"type": "function", "function": {"name"}}
            functions = [t["function"] for t in body["tools"]]
            forced = body["tool_choice"]
            named = None if forced == "required" else forced["function"]["name"]
            (call,) = [c["function"] for c in choice["message"]["tool_calls"]]
        else:  # the legacy functions with function_call {"name"}
            functions, named = body["functions"], body["function_call"]["name"]
            call = choice["message"]["function_call"]
        assert call["name"] == named if named else call["name"] in [f["name"] for f in functions]
        schema = next(f["parameters"] for f in functions if f["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)
        assert choice["message"]["content"] is None
        assert choice["finish_reason"] == ("stop" if named else "tool_calls"), (custom_id, choice)
