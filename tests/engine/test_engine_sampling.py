"""Per-request sampling: seeds, temperature/top-k/top-p, stop strings and ids, n, logprobs, limits."""

from __future__ import annotations

import math

import pytest
import torch

from bulkgen.engine import SamplingParams


def test_seeded_sampling_does_not_depend_on_batch_mates(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=10, count=5, low=3, high=40)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    alone = make_engine("llama").generate([prompts[0]], seeded)[0].token_ids
    others = [
        SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, ignore_eos=True) for n in (3, 20, 7, 15)
    ]
    crowd = make_engine("llama", max_num_batched_tokens=32).generate(prompts, [seeded, *others])
    assert crowd[0].token_ids == alone
    other_seed = (
        make_engine("llama")
        .generate([prompts[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=124, ignore_eos=True))[0]
        .token_ids
    )
    assert other_seed != alone


def test_top_k_one_is_greedy_and_high_temperature_spreads(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=11, count=1, low=20, high=20)[0]
    engine = make_engine("qwen3")
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=5.0, top_k=1, seed=0))[0]
    assert out.token_ids == reference.greedy("qwen3", prompt, 8)
    hot = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=50.0, seed=1, ignore_eos=True))[
        0
    ]
    assert len(set(hot.token_ids)) > 15  # near-uniform over ~260 tokens


def test_top_p_keeps_only_the_nucleus(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=12, count=1, low=10, high=10)[0]
    logits = reference.logits("llama", prompt)[-1]
    probs = torch.softmax(logits / 2.0, dim=-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.3).sum()) + 1].tolist())
    engine = make_engine("llama")
    firsts = {
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=2.0, top_p=0.3, seed=s))[
            0
        ].token_ids[0]
        for s in range(30)
    }
    assert firsts <= nucleus
    assert len(nucleus) > 1 and len(firsts) > 1


def test_stop_strings_stop_token_ids_and_eos(make_engine, reference, tokenizer):
    prompt = tokenizer("Once upon a time").input_ids
    greedy = reference.greedy("llama", prompt, 12)
    engine = make_engine("llama")
    text = tokenizer.decode(greedy, skip_special_tokens=True)
    stop = text[3:5]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    by_id = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[greedy[2]])
    )[0]
    assert by_id.token_ids == greedy[: greedy.index(greedy[2]) + 1] and by_id.finish_reason == "stop"
    capped = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert capped.token_ids == greedy[:2] and capped.finish_reason == "length"


def test_eos_stops_unless_ignored(model_dirs, reference, mixed_prompts):
    """The model's generation_config EOS ends a sequence (token kept, reason "stop") unless ignore_eos."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bulkgen.engine import Engine

    prompt = mixed_prompts(seed=13, count=1, low=10, high=10)[0]
    greedy = reference.greedy("llama", prompt, 6)
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    model.generation_config.eos_token_id = greedy[2]
    engine = Engine(model, AutoTokenizer.from_pretrained(model_dirs["llama"]))
    stopped = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    assert stopped.token_ids == greedy[: greedy.index(greedy[2]) + 1] and stopped.finish_reason == "stop"
    ignored = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"


def test_n_completions_and_logprobs(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=14, count=1, low=12, high=12)[0]
    engine = make_engine("qwen2")
    out = engine.generate(
        [prompt], SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=7, logprobs=2, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert out.metrics.num_output_tokens == 15
    logits = reference.logits("qwen2", prompt)[-1]
    logp = torch.log_softmax(logits, dim=-1)
    for c in out.outputs:
        first = c.logprobs[0]
        assert math.isclose(first["logprob"], float(logp[c.token_ids[0]]), abs_tol=1e-4)
        top = [e["logprob"] for e in first["top_logprobs"]]
        assert len(top) == 2 and top[0] >= top[1]
        assert math.isclose(top[0], float(logp.max()), abs_tol=1e-4)
        assert len(c.logprobs) == len(c.token_ids)


def test_context_length_limits(make_engine, mixed_prompts):
    engine = make_engine("llama", max_model_len=32)
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", list(range(32)), SamplingParams())
    out = engine.generate([list(range(28))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", -1),
        ("temperature", -1.0),
        ("temperature", None),
        ("top_p", -0.1),
        ("top_p", 1.5),
        ("top_p", None),
        ("top_k", -2),
        ("n", 0),
        ("logprobs", -1),
        ("seed", "x"),
        ("seed", -(2**63) - 1),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", None),
        ("logit_bias", {5: 101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", [1]),
        ("best_of", 0),
        ("prompt_logprobs", -1),
        ("max_tokens", 1.5),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field


def test_best_of_below_n_is_refused_and_the_spec_ranges_are_accepted():
    with pytest.raises(ValueError, match="best_of") as err:
        SamplingParams(n=3, best_of=2)
    assert err.value.field == "best_of"
    ok = [
        dict(max_tokens=0),
        dict(top_p=0.0),
        dict(seed=-(2**63)),
        dict(seed=2**64 - 1),
        dict(n=128),
        dict(max_tokens=2**63),
        dict(presence_penalty=-2, frequency_penalty=2.0),
        dict(logit_bias={0: -100, 7: 100.0}),
        dict(n=2, best_of=2),
        dict(prompt_logprobs=0),
    ]
    for values in ok:
        SamplingParams(**values)
    assert SamplingParams(top_p=0).greedy
