"""The scripted model (bulkgen/lab/scripted.py) writes its script exactly, the same tokens in transformers and
in bulkgen's engine, after each script's own prompt length."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import SamplingParams, engine_class
from bulkgen.lab.scripted import build_scripted_model
from tests.support.reasoning import QWEN3, TEMPLATES, build_family


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("scripted"), QWEN3)


def test_engine_and_transformers_write_the_script(qwen3_path):
    engine = engine_class().from_pretrained(str(qwen3_path))
    hf = AutoModelForCausalLM.from_pretrained(qwen3_path, local_files_only=True)
    for case in QWEN3.cases.values():
        prompt = QWEN3.prompt_ids(case)
        script = engine.tokenizer.encode(case.script, add_special_tokens=False)
        out = engine.generate([prompt], SamplingParams(max_tokens=300, temperature=0))[0].outputs[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=300, do_sample=False)[0, len(prompt) :]
        assert out.token_ids == script == ref.tolist()
        assert out.finish_reason == "stop"


def test_sampling_writes_the_script_too(qwen3_path):
    engine = engine_class().from_pretrained(str(qwen3_path))
    case = QWEN3.cases["think"]
    outs = engine.generate(
        [QWEN3.prompt_ids(case)], SamplingParams(max_tokens=300, temperature=1.0, n=3, seed=7)
    )
    assert {o.text for o in outs[0].outputs} == {
        engine.tokenizer.decode(engine.tokenizer.encode(case.script), skip_special_tokens=True)
    }


def test_scripts_that_share_positions_are_refused(tmp_path):
    template = (TEMPLATES / "qwen3.jinja").read_text()
    with pytest.raises(ValueError, match="taken by 10"):
        build_scripted_model(
            tmp_path, "qwen3", template, {10: "a long enough script", 12: "x"}, hidden_size=64
        )
