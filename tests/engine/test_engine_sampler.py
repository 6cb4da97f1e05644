"""The device sampler and its counter-based random numbers, tested directly on CPU tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bulkgen.engine.sampling import sampler
from bulkgen.engine.sampling.counter_rng import MASK32, hash32, hash32_py, stream_key, uniforms
from bulkgen.engine.sampling.sampling_params import SamplingParams


def test_device_hash_matches_the_python_reference_and_uniforms_are_open_and_flat():
    values = [0, 1, 2, 12345, MASK32, 0x9E3779B9, 2**31, 2**31 - 1]
    assert hash32(torch.tensor(values)).tolist() == [hash32_py(v) for v in values]
    key = stream_key(7, 0)
    u = uniforms(torch.tensor([key & MASK32]), torch.tensor([key >> 32]), torch.arange(200_000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    hist = torch.histc(u, bins=20, min=0, max=1) / u.numel()
    assert float((hist - 0.05).abs().max()) < 0.003


def test_stream_keys_are_distinct_across_seeds_and_completions():
    keys = {stream_key(seed, index) for seed in range(200) for index in range(4)}
    assert len(keys) == 800
    assert stream_key(5, 1) != stream_key(6, 0)
    assert stream_key(2**64 - 1, 1) != stream_key(2**64 - 1, 0)
    assert stream_key(2**70 + 3, 0) != stream_key(3, 0)


def _seqs(count, temperature=1.0, top_p=1.0, top_k=0, position=0, seed0=0):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)  # the engine's own
    return [
        SimpleNamespace(
            seq_id=i,
            params=params,
            rng_key=stream_key(seed0 + i, 0),
            num_output_tokens=position,
            adjusts_logits=False,
            cumulative_logprob=None,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.7, 0), (1.0, 3), (0.9, 4), (0.05, 0)])
def test_sampled_frequencies_follow_the_truncated_distribution(top_p, top_k):
    """Many rows with the same logits and different keys: token frequencies match softmax restricted to
    the top-k then the top-p nucleus (0.05 forces the sorted fallback: the nucleus is one token)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = 4000
    tokens = torch.tensor(sampler.sample(logits.repeat(rows, 1), _seqs(rows, top_p=top_p, top_k=top_k))[0])
    probs = torch.softmax(logits, 0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    p = probs * keep / (probs * keep).sum()
    before = p.cumsum(0) - p
    keep &= before < top_p
    want = p * keep / (p * keep).sum()
    got = torch.bincount(tokens, minlength=len(logits)).float() / rows
    assert float((got - want).abs().max()) < 0.03, (got, want)
    assert not bool(got[~keep].any())


def test_a_row_samples_the_same_token_alone_and_in_any_crowd():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    seqs = _seqs(16, temperature=0.8, top_p=0.95, position=5)
    crowd, _ = sampler.sample(logits.clone(), seqs)
    for i in (0, 7, 15):
        alone, _ = sampler.sample(logits[i : i + 1].clone(), [seqs[i]])
        assert alone == [crowd[i]]
    shuffled, _ = sampler.sample(logits.flip(0), seqs[::-1])
    assert shuffled[::-1] == crowd


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    greedy = SimpleNamespace(
        params=SamplingParams(temperature=0.0), adjusts_logits=False, cumulative_logprob=None
    )
    seqs = [greedy, *_seqs(1, top_p=0.9), greedy, *_seqs(1, seed0=9)]
    tokens, logprobs = sampler.sample(logits, seqs)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert logprobs == [None] * 4
