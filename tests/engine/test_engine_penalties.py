"""Presence/frequency penalties and logit_bias, token for token against transformers' `generate`.

The reference applies OpenAI's formula with a LogitsProcessor written here (counts over the generated
tokens only) and logit_bias with transformers' own SequenceBiasLogitsProcessor (single-token sequences),
greedy, fp32, one prompt at a time; the engine runs the same requests together in one batch, mixed with
requests that use neither (which must still equal plain greedy).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, SequenceBiasLogitsProcessor

from bulkgen.engine import SamplingParams
from bulkgen.engine.sampling.penalties import LogitAdjustments

ARCH = "llama"
MAX_NEW = 12


class OpenAIPenalties(LogitsProcessor):
    """logits[t] -= frequency * count[t] + presence * (count[t] > 0), counts over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_greedy(reference, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' greedy generate with the request's penalties and logit_bias as logits processors."""
    reference.greedy(ARCH, prompt[:1], 1)  # loads (and memoises) the reference model
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    if params.logit_bias:
        processors.append(
            SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in params.logit_bias.items()])
        )
    with torch.no_grad():
        out = reference.models[ARCH].generate(
            torch.tensor([prompt]),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            logits_processor=processors,
        )
    return out[0, len(prompt) :].tolist()


def _requests(prompts: list[list[int]], reference) -> list[SamplingParams]:
    """Penalties go to the prompts whose plain greedy output repeats itself (2 and 3)."""
    greedy_first = reference.greedy(ARCH, prompts[1], MAX_NEW)
    return [
        SamplingParams(max_tokens=MAX_NEW, temperature=0, logit_bias={97: 4.5, 101: 4.0, 32: -1.0}),
        SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0,
            presence_penalty=1.5,
            frequency_penalty=0.5,
            logit_bias={greedy_first[0]: -100, 65: 3.0},
        ),
        SamplingParams(max_tokens=MAX_NEW, temperature=0, frequency_penalty=2.0),
        SamplingParams(
            max_tokens=MAX_NEW, temperature=0, top_p=0.0, presence_penalty=1.0, frequency_penalty=-0.7
        ),  # top_p 0 is greedy too
        SamplingParams(max_tokens=MAX_NEW, temperature=0),  # plain greedy, batched with the others
        SamplingParams(max_tokens=MAX_NEW, temperature=0, presence_penalty=-2.0),  # favours repeats
        SamplingParams(max_tokens=MAX_NEW, temperature=0.7, top_p=0.0),  # greedy, no penalties
    ]


@pytest.mark.parametrize(
    "engine_kwargs", [{}, {"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 16, "cuda_graphs": True}]
)
def test_penalties_and_logit_bias_match_transformers_generate(
    make_engine, reference, mixed_prompts, engine_kwargs
):
    """Seven prompts of 3-40 tokens in one engine batch; 16 tokens per step chunks the prefills, and
    cuda_graphs runs the decode steps through the decode-graph path (eagerly, on CPU)."""
    prompts = mixed_prompts(seed=60, count=7, low=3, high=40)
    params = _requests(prompts, reference)
    engine = make_engine(ARCH, **engine_kwargs)
    outs = engine.generate(prompts, params)
    changed = 0
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        want = hf_greedy(reference, prompt, p)
        assert out.token_ids == want, (p, out.token_ids, want)
        plain = reference.greedy(ARCH, prompt, MAX_NEW)
        if not p.adjusts_logits:
            assert out.token_ids == plain
        changed += out.token_ids != plain
    assert changed >= 4  # the penalties and biases really changed what greedy picks


def test_logprobs_report_the_processed_distribution(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=61, count=1, low=9, high=9)[0]
    bias = {7: 50.0}
    out = (
        make_engine(ARCH)
        .generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=1, logit_bias=bias))[0]
        .outputs[0]
    )
    logits = reference.logits(ARCH, prompt)[-1].clone()
    logits[7] += 50.0
    logp = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == [7]
    assert out.logprobs[0]["logprob"] == pytest.approx(float(logp[7]), abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(float(logp[7]), abs=1e-4)


def test_seeded_sampling_with_penalties_is_the_same_alone_and_in_a_crowd(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=62, count=6, low=3, high=30)
    seeded = SamplingParams(
        max_tokens=16,
        temperature=1.0,
        top_p=0.9,
        seed=-7,
        presence_penalty=1.2,
        frequency_penalty=0.8,
        logit_bias={10: 2.0, 20: -5.0},
        ignore_eos=True,
    )
    alone = make_engine(ARCH).generate([prompts[0]], seeded)[0]
    others = [
        SamplingParams(max_tokens=9, temperature=0.8, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.3, logit_bias={3: 1.0}, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.9, top_k=5, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
    ]
    crowd = make_engine(ARCH, max_num_batched_tokens=24).generate(prompts, [seeded, *others])[0]
    assert crowd.token_ids == alone.token_ids
    unpenalised = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=-7, ignore_eos=True)
    assert make_engine(ARCH).generate([prompts[0]], unpenalised)[0].token_ids != alone.token_ids


def _dense_adjustment(seq, vocab: int) -> torch.Tensor:
    p = seq.params
    out = torch.tensor(seq.token_ids[seq.num_prompt_tokens :])
    counts = torch.bincount(out, minlength=vocab).float() if len(out) else torch.zeros(vocab)
    delta = -p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    for token, bias in (p.logit_bias or {}).items():
        delta[token] += bias
    return delta


def test_adjustment_rows_catch_up_with_the_tokens_and_are_reused():
    """Rows are built once, then follow each sequence's new tokens; a released row is clean when reused."""
    vocab, gen = 50, torch.Generator().manual_seed(3)

    def seq(seq_id, params, prompt_len=4):
        tokens = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        return SimpleNamespace(
            seq_id=seq_id,
            params=params,
            token_ids=tokens,
            num_prompt_tokens=prompt_len,
            adjusts_logits=params.adjusts_logits,
        )

    seqs = [
        seq(0, SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3, logit_bias={2: 5.0, 9: -1.5})),
        seq(1, SamplingParams()),
        seq(2, SamplingParams(presence_penalty=1.1)),
    ]
    adjustments = LogitAdjustments()
    for step in range(12):
        logits = torch.randn(3, vocab, generator=gen)
        got = logits.clone()
        adjustments.apply(got, seqs)
        for s, before, after in zip(seqs, logits, got, strict=True):
            assert torch.allclose(after - before, _dense_adjustment(s, vocab), atol=1e-5), (step, s.seq_id)
        for s in seqs:
            s.token_ids += torch.randint(0, 8, (1 + step % 2,), generator=gen).tolist()  # repeats likely
    assert set(adjustments.rows) == {0, 2}
    adjustments.release(seqs[0])
    seqs[0] = seq(3, SamplingParams(logit_bias={4: 2.0}))
    logits = torch.zeros(3, vocab)
    adjustments.apply(logits, seqs)
    assert torch.equal(logits[0], _dense_adjustment(seqs[0], vocab)) and len(adjustments.rows) == 2
    assert adjustments.pool.shape[0] == 8  # the released row was reused, the pool did not grow


def test_the_engine_releases_adjustment_rows(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=63, count=3, low=4, high=9)
    engine = make_engine(ARCH)
    params = SamplingParams(max_tokens=5, temperature=0, frequency_penalty=1.0, n=2)
    engine.generate(prompts, params)
    engine.add_request("dropped", prompts[0], params)
    engine.step()
    assert len(engine.adjustments.rows) == 2
    engine.abort(["dropped"])
    assert not engine.adjustments.rows and len(engine.adjustments.free) == engine.adjustments.pool.shape[0]
