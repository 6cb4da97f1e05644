"""vLLM's sampling extensions: min_p and repetition_penalty (top_k's own tests are in test_engine_sampling).

repetition_penalty is checked token for token against transformers' greedy `generate(repetition_penalty=)`
(RepetitionPenaltyLogitsProcessor: prompt and output tokens), in one engine batch with rows that use none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.config import EngineConfig
from bulkgen.engine.sampling.sampling_params import SamplingError, generation_defaults

ARCH = "llama"
MAX_NEW = 12


def hf_greedy_repetition(reference, prompt: list[int], penalty: float, max_new: int) -> list[int]:
    reference.greedy(ARCH, prompt[:1], 1)  # loads (and memoises) the reference model
    with torch.no_grad():
        out = reference.models[ARCH].generate(
            torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, repetition_penalty=penalty
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16}])
def test_repetition_penalty_matches_transformers_generate(
    make_engine, reference, mixed_prompts, engine_kwargs
):
    prompts = mixed_prompts(seed=70, count=5, low=3, high=40)
    penalties = [1.3, 2.0, 0.7, 1.0, 1.15]  # < 1 favours repeats; 1.0 is plain greedy in the same batch
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, repetition_penalty=p) for p in penalties]
    outs = make_engine(ARCH, **engine_kwargs).generate(prompts, params)
    changed = 0
    for prompt, penalty, out in zip(prompts, penalties, outs, strict=True):
        want = hf_greedy_repetition(reference, prompt, penalty, MAX_NEW)
        assert out.token_ids == want, (penalty, out.token_ids, want)
        changed += out.token_ids != reference.greedy(ARCH, prompt, MAX_NEW)
    assert changed >= 2  # the penalty really changed what greedy picks


def test_min_p_one_is_greedy_and_min_p_keeps_only_likely_tokens(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=71, count=1, low=12, high=12)[0]
    engine = make_engine(ARCH)
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=2.0, min_p=1.0, seed=0))[0]
    assert out.token_ids == reference.greedy(ARCH, prompt, 8)
    probs = torch.softmax(reference.logits(ARCH, prompt)[-1], dim=-1)
    ratios = (probs / probs.max()).sort(descending=True).values
    min_p = float(ratios[5] + ratios[6]) / 2  # halfway between the 6th and 7th token: keeps six
    kept = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    firsts = {
        engine.generate([prompt], SamplingParams(max_tokens=1, min_p=min_p, seed=s))[0].token_ids[0]
        for s in range(40)
    }
    assert firsts <= kept and len(kept) == 6 and len(firsts) > 1, firsts
    loose = {
        engine.generate([prompt], SamplingParams(max_tokens=1, seed=s))[0].token_ids[0] for s in range(40)
    }
    assert not loose <= kept  # without min_p the same seeds leave that set


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("min_p", None),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
    ],
)
def test_bad_extension_values_name_the_field(field, value):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.fixture
def defaults_model(model_dirs, tmp_path):
    """The tiny llama with a generation_config.json that defaults top_k=1 and temperature=5."""
    folder = tmp_path / "llama-defaults"
    shutil.copytree(model_dirs[ARCH], folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "top_k": 1, "temperature": 5.0}))
    return str(folder)


def test_generation_config_defaults_apply_where_the_request_sets_none(
    defaults_model, reference, mixed_prompts
):
    prompt = mixed_prompts(seed=72, count=1, low=10, high=10)[0]
    greedy = reference.greedy(ARCH, prompt, 8)
    engine = Engine.from_pretrained(defaults_model, device="cpu")
    assert engine.sampling_defaults == {"top_k": 1, "temperature": 5.0}  # nothing else: GenerationConfig's
    # class defaults (top_k 50) are not the model's
    line = {"max_tokens": 8, "seed": 0, "ignore_eos": True}
    assert engine.generate([prompt], engine.sampling_params(line))[0].token_ids == greedy  # top_k 1
    overridden = engine.sampling_params({**line, "top_k": 0})  # the line's "off" beats the model's 1
    assert (overridden.top_k, overridden.temperature) == (0, 5.0)
    assert engine.generate([prompt], overridden)[0].token_ids != greedy
    off = Engine.from_pretrained(defaults_model, device="cpu", generation_config="none")
    assert off.sampling_defaults == {}
    plain = off.sampling_params(line)
    assert (plain.top_k, plain.temperature) == (0, 1.0)  # OpenAI's defaults
    assert off.generate([prompt], plain)[0].token_ids != greedy


def test_generation_defaults_reads_only_what_the_config_sets():
    assert generation_defaults(GenerationConfig(temperature=0.6, top_p=0.95)) == {
        "temperature": 0.6,
        "top_p": 0.95,
    }
    assert generation_defaults(GenerationConfig(top_k=-1, min_p=0.1, repetition_penalty=1.1)) == {
        "top_k": 0,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
    }
    assert generation_defaults(GenerationConfig(top_p=3.0, temperature=0.7)) == {
        "temperature": 0.7
    }  # unrunnable: left out
    assert generation_defaults(None) == {}
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="vllm")


def test_the_generation_config_flag_names_the_engine_modes():
    from bulkgen import settings
    from bulkgen.engine import config

    assert settings.GENERATION_CONFIG_MODES == config.GENERATION_CONFIG_MODES
    assert settings.ENGINE_FLAGS["generation_config"].choices == config.GENERATION_CONFIG_MODES


def test_system_fingerprint_is_stable_and_tracks_what_changes_tokens(model_dirs, defaults_model):
    path = str(model_dirs[ARCH])
    first = Engine.from_pretrained(path, device="cpu").system_fingerprint
    assert first.startswith("fp_") and len(first) == 15
    assert (
        Engine.from_pretrained(path, device="cpu", max_num_seqs=3).system_fingerprint == first
    )  # no token change
    copy = Path(defaults_model).parent / "copy"
    shutil.copytree(path, copy)  # another folder, same checkpoint: the same fingerprint (no paths, no times)
    assert Engine.from_pretrained(str(copy), device="cpu").system_fingerprint == first
    others = {
        Engine.from_pretrained(path, device="cpu", dtype="bfloat16").system_fingerprint,
        Engine.from_pretrained(path, device="cpu", kv_cache_dtype="fp8").system_fingerprint,
        Engine.from_pretrained(path, device="cpu", max_model_len=64).system_fingerprint,
        Engine.from_pretrained(defaults_model, device="cpu").system_fingerprint,  # generation_config changed
        Engine.from_pretrained(defaults_model, device="cpu", generation_config="none").system_fingerprint,
    }
    assert first not in others and len(others) == 5
