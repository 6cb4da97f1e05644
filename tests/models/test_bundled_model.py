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
