"""`bulkgen plan` for a hybrid model: its measured profile says the engine keeps no prefix cache, so the
plan counts every sequence's whole prompt (no block is shared between requests or between the `n`
completions of one), where a transformer's plan counts a repeated prompt once."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from bulkgen.lab.tiny_hybrid import build_tiny_hybrid
from bulkgen.plan import profile as profiles
from bulkgen.plan.lengths import UPPER_BOUND
from bulkgen.plan.planner import plan_file

PROMPT = "a prompt long enough to fill several cache blocks " * 3


def _line(custom_id: str, **body) -> str:
    body = {"model": "hybrid", "prompt": PROMPT, "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


@pytest.mark.subprocess  # the profile measures in a child process
def test_a_hybrid_models_plan_shares_no_prompt_tokens(tmp_path):
    path = build_tiny_hybrid(tmp_path / "model", "lfm2", seed=1)
    engine = {"max_num_seqs": 1, "device": "cpu"}
    profile = profiles.measure("hybrid", str(path), engine, threads=1, startup=False)
    assert profile.prefix_caching is False
    file = tmp_path / "f.jsonl"
    lines = [_line("a"), _line("b", n=2)] + [_line(f"c{i}") for i in range(40)]  # enough to show in seconds
    file.write_text("\n".join(lines) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = len(tokenizer(PROMPT).input_ids)

    def planned(p: profiles.Profile) -> dict:
        return plan_file(
            file, "/v1/completions", "hybrid", str(path), tokenizer, UPPER_BOUND, 1, 100, profile=p
        )

    hybrid = planned(profile)
    assert hybrid["prompt_tokens"] == 42 * prompt and hybrid["prefix_cache_share"] == 0.0
    cached = planned(dataclasses.replace(profile, prefix_caching=True))
    assert cached["prefix_cache_share"] > 0.4  # the second request's full blocks
    print(hybrid["estimated_seconds"], cached["estimated_seconds"])
    assert hybrid["estimated_seconds"]["expected"] > cached["estimated_seconds"]["expected"]
