"""`bulkgen run` serves a hybrid model (Qwen3-Next: Gated DeltaNet layers beside attention) saved to a
folder, through every door: chat (with structured output and n=2), completions, responses, embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bulkgen.lab.tiny_hybrid import build_tiny_hybrid
from tests.support.service import run_bodies

NAME = "hybrid-tiny"
SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["bug", "praise"]}},
    "required": ["label"],
    "additionalProperties": False,
}
PROMPTS = ["The three primary colors are", "Q: What is the capital of Australia?\nA:"]


def _line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": NAME, **body}}


def _run(tmp_path, model, name: str, rows: list[dict]) -> dict:
    return run_bodies(tmp_path, name, rows, "--model", f"{NAME}={model}")


@pytest.mark.ray  # `bulkgen run`: a local Ray and its worker
def test_bulkgen_run_serves_a_hybrid_model_through_every_door(tmp_path):
    model = build_tiny_hybrid(tmp_path / "model", "qwen3_next", seed=1)
    chat = _run(
        tmp_path,
        model,
        "chat",
        [
            _line(
                "plain", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=6
            ),
            _line(
                "two", "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=6
            ),
            _line(
                "schema",
                "/v1/chat/completions",
                messages=[{"role": "user", "content": "Label: the app crashes"}],
                max_tokens=40,
                temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "l", "schema": SCHEMA}},
            ),
        ],
    )
    assert len(chat["two"]["choices"]) == 2
    assert json.loads(chat["schema"]["choices"][0]["message"]["content"])["label"] in ("bug", "praise")

    completions = _run(
        tmp_path,
        model,
        "completions",
        [
            _line(f"c{i}", "/v1/completions", prompt=p, max_tokens=8, temperature=0)
            for i, p in enumerate(PROMPTS)
        ],
    )
    reference = AutoModelForCausalLM.from_pretrained(model).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :]
        assert completions[f"c{i}"]["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)

    responses = _run(
        tmp_path,
        model,
        "responses",
        [
            _line(
                "r",
                "/v1/responses",
                input="Label: great app",
                max_output_tokens=40,
                text={"format": {"type": "json_schema", "name": "l", "schema": SCHEMA}},
            )
        ],
    )
    assert json.loads(responses["r"]["output"][0]["content"][0]["text"])["label"] in ("bug", "praise")

    embeddings = _run(
        tmp_path, model, "embeddings", [_line("e", "/v1/embeddings", input=["one text", "another one"])]
    )
    vectors = [d["embedding"] for d in embeddings["e"]["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == 64 and vectors[0] != vectors[1]
