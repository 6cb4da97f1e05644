"""best_of, max_tokens 0, prompt_logprobs and the extremes of the sampling ranges."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import SamplingParams
from bulkgen.engine import scheduler as scheduler_module
from bulkgen.engine.sampling.counter_rng import stream_key

ARCH = "llama"


def _mean(c) -> float:
    return c.cumulative_logprob / len(c.token_ids)


def test_best_of_returns_the_top_n_by_mean_logprob(make_engine, mixed_prompts):
    prompt = mixed_prompts(seed=70, count=1, low=11, high=11)[0]
    common = dict(temperature=1.2, seed=31, max_tokens=10, frequency_penalty=0.3)
    engine = make_engine(ARCH)
    best = engine.generate([prompt], SamplingParams(n=3, best_of=7, **common))[0]
    every = engine.generate([prompt], SamplingParams(n=7, logprobs=0, **common))[0]
    for c in every.outputs:
        assert c.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in c.logprobs), abs=1e-4)
    ranked = sorted(every.outputs, key=lambda c: -_mean(c))
    assert len({round(_mean(c), 6) for c in every.outputs}) == 7  # no ties: the ranking is unambiguous
    assert [c.index for c in best.outputs] == [0, 1, 2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:3]]
    assert [c.cumulative_logprob for c in best.outputs] == pytest.approx(
        [c.cumulative_logprob for c in ranked[:3]]
    )
    assert all(c.logprobs is None for c in best.outputs)  # ranked without logprobs being asked for
    assert best.metrics.num_output_tokens == sum(len(c.token_ids) for c in every.outputs)  # usage: all 7


def test_max_tokens_zero_comes_back_empty_without_a_forward(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=71, count=2, low=5, high=12)
    engine = make_engine(ARCH)
    engine.add_request("zero", prompts[0], SamplingParams(max_tokens=0, n=3, logprobs=2))
    out = engine.step()
    assert [o.request_id for o in out] == ["zero"] and not engine.has_unfinished()
    assert engine.stats()["steps"] == 0 and engine.stats()["prefill_tokens"] == 0
    zero = out[0]
    assert [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in zero.outputs] == [
        (i, [], "", "length", []) for i in range(3)
    ]
    assert zero.prompt_logprobs is None and zero.metrics.num_output_tokens == 0
    engine.add_request("busy", prompts[1], SamplingParams(max_tokens=5, temperature=0))
    engine.step()
    engine.add_request("zero2", prompts[0], SamplingParams(max_tokens=0))
    engine.add_request("gone", prompts[0], SamplingParams(max_tokens=0))
    engine.abort(["gone"])
    assert [o.request_id for o in engine.step()] == ["zero2"]
    while engine.has_unfinished():
        engine.step()
    assert [len(o.token_ids) for o in engine.generate(prompts, SamplingParams(max_tokens=0))] == [0, 0]


def _check_prompt_logprobs(reference, prompt: list[int], entries: list[dict], k: int, tokenizer) -> None:
    """Against log_softmax of a full-sequence forward of the transformers model."""
    logp = torch.log_softmax(reference.logits(ARCH, prompt), dim=-1)
    assert len(entries) == len(prompt) - 1
    for pos, entry in enumerate(entries):
        target = prompt[pos + 1]
        assert entry["token"] == tokenizer.decode([target])
        assert entry["logprob"] == pytest.approx(float(logp[pos, target]), abs=1e-4)
        top_vals, top_ids = logp[pos].topk(k)
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(top_vals.tolist(), abs=1e-4)
        assert [e["token"] for e in entry["top_logprobs"]] == [
            tokenizer.decode([i]) for i in top_ids.tolist()
        ]


@pytest.mark.parametrize(
    "engine_kwargs,logit_rows",
    [
        (dict(max_num_batched_tokens=8, block_size=4), None),  # chunked prefill: 8 tokens per step
        (dict(max_num_batched_tokens=64, block_size=4), 5),  # at most 5 prompt-logit rows per step
        (
            dict(max_num_batched_tokens=3, block_size=4, cuda_graphs=True),
            None,
        ),  # 1-token chunks beside decodes
    ],
)
def test_prompt_logprobs_match_a_full_forward(
    make_engine, reference, tokenizer, mixed_prompts, monkeypatch, engine_kwargs, logit_rows
):
    """The third case: two decodes fill 2 of 3 tokens, so the prompt is scored one token per step on
    the decode-graph path (run eagerly on CPU), whose rows must map back to the right sequences."""
    if logit_rows:
        monkeypatch.setattr(scheduler_module, "PROMPT_LOGIT_ROWS", logit_rows)
    prompts = mixed_prompts(seed=72, count=2, low=30, high=30)
    engine = make_engine(ARCH, **engine_kwargs)
    params = [
        SamplingParams(max_tokens=40, n=2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3, ignore_eos=True),
    ]
    outs = engine.generate([[5], prompts[1]], params)
    _check_prompt_logprobs(reference, prompts[1], outs[1].prompt_logprobs, 3, tokenizer)
    assert outs[1].token_ids == reference.greedy(ARCH, prompts[1], 4)
    assert outs[0].token_ids == reference.greedy(ARCH, [5], 40) and outs[0].prompt_logprobs is None


def test_prompt_logprobs_skip_the_prefix_cache_and_others_still_hit_it(
    make_engine, reference, tokenizer, mixed_prompts
):
    shared = mixed_prompts(seed=73, count=1, low=24, high=24)[0]
    tails = mixed_prompts(seed=74, count=3, low=5, high=9)
    engine = make_engine(ARCH, block_size=4)
    engine.generate([shared + tails[0]], SamplingParams(max_tokens=2, temperature=0))  # fills the cache
    scored, plain, zero = (shared + t for t in tails)
    outs = engine.generate(
        [scored, plain, zero],
        [
            SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, n=3),
            SamplingParams(max_tokens=3, temperature=0),
            SamplingParams(max_tokens=0, prompt_logprobs=0, n=2),
        ],
    )
    _check_prompt_logprobs(reference, scored, outs[0].prompt_logprobs, 2, tokenizer)
    _check_prompt_logprobs(reference, zero, outs[2].prompt_logprobs, 0, tokenizer)
    assert outs[0].metrics.num_cached_tokens == 0 and outs[2].metrics.num_cached_tokens == 0
    assert outs[1].metrics.num_cached_tokens >= 24
    assert all(c.token_ids == reference.greedy(ARCH, scored, 3) for c in outs[0].outputs)
    assert [(c.token_ids, c.finish_reason) for c in outs[2].outputs] == [([], "length")] * 2


def test_extreme_seeds_n_and_max_tokens(make_engine, mixed_prompts):
    prompt = mixed_prompts(seed=75, count=1, low=6, high=6)[0]
    assert stream_key(-1, 0) == stream_key(2**64 - 1, 0) and stream_key(-(2**63), 3) == stream_key(2**63, 3)
    engine = make_engine(ARCH, max_model_len=64)
    sample = dict(max_tokens=4, temperature=1.0, ignore_eos=True)
    negative = engine.generate([prompt], SamplingParams(seed=-1, **sample))[0].token_ids
    assert negative == engine.generate([prompt], SamplingParams(seed=2**64 - 1, **sample))[0].token_ids
    assert negative != engine.generate([prompt], SamplingParams(seed=1, **sample))[0].token_ids
    many = engine.generate(
        [prompt], SamplingParams(n=128, max_tokens=3, temperature=1.0, seed=9, top_k=2**63, ignore_eos=True)
    )[0]
    assert [c.index for c in many.outputs] == list(range(128)) and many.metrics.num_output_tokens == 384
    assert len({tuple(c.token_ids) for c in many.outputs}) > 64
    huge = engine.generate([prompt], SamplingParams(max_tokens=2**63, n=3, temperature=0, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in huge.outputs] == [64 - len(prompt)] * 3
    assert {c.finish_reason for c in huge.outputs} == {"length"}


def test_requests_that_cannot_run_are_refused_naming_them(make_engine, mixed_prompts):
    prompt = mixed_prompts(seed=76, count=1, low=10, high=10)[0]
    engine = make_engine(ARCH, num_kv_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="'big'.*128 sequences needs 5 KV blocks but the cache has 4"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=2**63, n=128))
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=f"'bias'.*logit_bias token ids \\[{vocab}\\]"):
        engine.add_request("bias", prompt, SamplingParams(logit_bias={vocab: 1.0, 3: 1.0}))
    with pytest.raises(ValueError, match="'scores'.*prompt_logprobs"):
        engine.add_request("scores", prompt, SamplingParams(prompt_logprobs=vocab + 1))
    assert not engine.has_unfinished()
    out = engine.generate([prompt], SamplingParams(max_tokens=6, n=2, temperature=0, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [6, 6]  # the sequences run one after another


def test_a_one_token_prefill_chunk_beside_decodes_on_the_decode_graph_path(
    make_engine, reference, mixed_prompts
):
    """Two decodes take 2 of the 3 tokens per step, so the other prompt is prefilled one token per step in
    decode-only plans: the graph path returns a row per sequence, and only the sampling ones may be used
    (before, the extra row reached the sampler and the step failed)."""
    prompt = mixed_prompts(seed=77, count=1, low=12, high=12)[0]
    engine = make_engine(ARCH, max_num_batched_tokens=3, cuda_graphs=True)
    outs = engine.generate(
        [[5], prompt],
        [
            SamplingParams(max_tokens=20, n=2, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        ],
    )
    assert outs[1].token_ids == reference.greedy(ARCH, prompt, 3)
    assert outs[0].token_ids == reference.greedy(ARCH, [5], 20)


def test_prompt_logprobs_survive_preemption(make_engine, reference, tokenizer, mixed_prompts):
    """Ten KV blocks for two sequences of nine: the scored prefill is preempted and recomputed, and its
    entries continue where they stopped (none repeated, none missing)."""
    prompt = mixed_prompts(seed=78, count=1, low=30, high=30)[0]
    engine = make_engine(ARCH, max_num_batched_tokens=8, block_size=4, num_kv_blocks=10)
    outs = engine.generate(
        [[1, 2, 3], prompt],
        [
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True),
        ],
    )
    assert outs[1].metrics.num_preemptions > 0
    _check_prompt_logprobs(reference, prompt, outs[1].prompt_logprobs, 1, tokenizer)
    assert outs[1].token_ids == reference.greedy(ARCH, prompt, 3)
