"""vLLM's sampling extensions: min_p and repetition_penalty (top_k's own tests are in test_engine_sampling).

repetition_penalty is checked token for token against transformers' greedy `generate(repetition_penalty=)`
(RepetitionPenaltyLogitsProcessor: prompt and output tokens), in one engine batch with rows that use none.
"""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import SamplingParams
from bulkgen.engine.sampling_params import SamplingError

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
