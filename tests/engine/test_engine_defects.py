"""Edges where an engine goes wrong easily: logprobs past the vocabulary, a failed step, overlapping
completion seeds, bf16 attention scores, near-zero temperatures, half-queued requests, and a caller's
model whose attention the engine must leave alone."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import SamplingParams
from bulkgen.engine import engine as engine_module
from bulkgen.engine.attention.attn_backends import PlainBackend
from bulkgen.engine.attention.attn_select import run_backend
from bulkgen.engine.attention.layer_attention import FULL, LayerAttention
from bulkgen.engine.step_plan import StepPlan


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_logprobs_beyond_vocab_is_refused_and_engine_keeps_working(make_engine, reference, mixed_prompts):
    prompts = mixed_prompts(seed=40, count=2, low=5, high=12)
    engine = make_engine("llama")
    engine.add_request("ok", prompts[0], _greedy(4))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("bad", prompts[1], SamplingParams(max_tokens=4, logprobs=engine.vocab_size + 1))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [o.request_id for o in done] == ["ok"]
    assert done[0].token_ids == reference.greedy("llama", prompts[0], 4)
    full = engine.generate(
        [prompts[1]], SamplingParams(max_tokens=2, temperature=0, logprobs=engine.vocab_size)
    )
    assert len(full[0].outputs[0].logprobs[0]["top_logprobs"]) == engine.vocab_size


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_leaves_the_engine_consistent(
    make_engine, reference, mixed_prompts, monkeypatch, overlap
):
    """A step whose sampling raises advances nothing: the next steps produce the reference tokens (also
    with overlapped steps, where the failing step's predecessor is still in flight)."""
    prompts = mixed_prompts(seed=41, count=3, low=5, high=30)
    engine = make_engine(
        "llama", max_num_batched_tokens=32, block_size=4, async_scheduling=overlap, cuda_graphs=overlap
    )
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _greedy(6))
    real, calls = engine_module.sample_async, []

    def flaky(logits, seqs, *rest):
        calls.append(1)
        if len(calls) in (2, 5):
            raise RuntimeError("injected sampling failure")
        return real(logits, seqs, *rest)

    monkeypatch.setattr(engine_module, "sample_async", flaky)
    done, failures = {}, 0
    while engine.has_unfinished():
        try:
            done.update((o.request_id, o.token_ids) for o in engine.step())
        except RuntimeError:
            failures += 1
    assert failures == 2
    assert done == {str(i): reference.greedy("llama", p, 6) for i, p in enumerate(prompts)}
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_completion_seeds_do_not_overlap_the_next_seed(make_engine, mixed_prompts):
    prompt = mixed_prompts(seed=42, count=1, low=8, high=8)[0]
    engine = make_engine("llama")
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    pair = engine.generate([prompt], SamplingParams(seed=5, n=2, **params))[0]
    six = engine.generate([prompt], SamplingParams(seed=6, **params))[0]
    assert pair.outputs[1].token_ids != six.outputs[0].token_ids
    again = engine.generate([prompt], SamplingParams(seed=5, n=2, **params))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in pair.outputs]


def _reference_attention(plan, q, k, v, k_cache, v_cache, scale):
    """float64 attention of each sequence over its cached context plus this step's tokens."""
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    bs, hkv = plan.block_size, k.shape[1]
    slots = torch.tensor(plan.slots())
    k_cache.view(-1, hkv, k.shape[2])[slots] = k.double()
    v_cache.view(-1, hkv, v.shape[2])[slots] = v.double()
    out, q_off = [], 0
    for start, n, table in zip(plan.starts, plan.counts, plan.block_tables, strict=True):
        end = start + n
        rows = torch.tensor([table[p // bs] * bs + p % bs for p in range(end)])
        ks = k_cache.view(-1, hkv, k.shape[2])[rows].repeat_interleave(q.shape[1] // hkv, 1)
        vs = v_cache.view(-1, hkv, v.shape[2])[rows].repeat_interleave(q.shape[1] // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q_off : q_off + n].double(), ks) * scale
        causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, vs))
        q_off += n
    return torch.cat(out)


def _long_decode_plan(bs: int = 16) -> StepPlan:
    """A fresh 9-token prompt and four decodes over 200-512 tokens of cached context."""
    starts, counts, tables, used = [0, 200, 257, 300, 511], [9, 1, 1, 1, 1], [], 0
    for start, n in zip(starts, counts, strict=True):
        width = -(-(start + n) // bs)
        tables.append(list(range(used, used + width)))
        used += width
    return StepPlan(starts, counts, tables, num_prefill=1, block_size=bs)


def test_bf16_decode_keeps_scores_in_float32():
    """At a larger query scale, bf16-rounded scores give ~0.0095 relative error here (fp32 scores: ~0.0017,
    about the bf16 rounding of the output itself)."""
    torch.manual_seed(0)
    plan = _long_decode_plan()
    heads, kv_heads, dim, blocks = 8, 2, 64, sum(len(t) for t in plan.block_tables)
    tokens = sum(plan.counts)
    q = (torch.randn(tokens, heads, dim) * 8).bfloat16()
    k, v = torch.randn(tokens, kv_heads, dim).bfloat16(), torch.randn(tokens, kv_heads, dim).bfloat16()
    k_cache = torch.randn(blocks, 16, kv_heads, dim).bfloat16()
    v_cache = torch.randn(blocks, 16, kv_heads, dim).bfloat16()
    scale = dim**-0.5
    got = run_backend(
        PlainBackend(),
        plan,
        LayerAttention(FULL, kv_heads, dim, dim, q_heads=heads),
        q,
        k,
        v,
        k_cache,
        v_cache,
        scale,
    ).double()
    want = _reference_attention(plan, q, k, v, k_cache, v_cache, scale)
    for rows in (slice(plan.num_prefill_tokens, None), slice(0, plan.num_prefill_tokens)):
        rel = float((got[rows] - want[rows]).norm() / want[rows].norm())
        assert rel < 0.004, f"relative error {rel:.4f} against float64 (rows {rows})"


def test_tiny_temperature_is_greedy(make_engine, reference, mixed_prompts):
    prompt = mixed_prompts(seed=43, count=1, low=10, high=10)[0]
    engine = make_engine("llama")
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1e-39, ignore_eos=True))[0]
    assert out.token_ids == reference.greedy("llama", prompt, 6)
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy


def test_a_request_is_checked_whole_before_any_part_is_queued(
    make_engine, reference, mixed_prompts, monkeypatch
):
    prompts = mixed_prompts(seed=44, count=2, low=5, high=10)
    engine = make_engine("llama")
    huge = engine.generate([prompts[0]], SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, n=2))[
        0
    ]
    assert [len(c.token_ids) for c in huge.outputs] == [3, 3]
    real = engine_module.Sequence

    def second_fails(seq_id, request, index, max_tokens):
        if index == 1:
            raise ValueError("injected failure building completion 1")
        return real(seq_id, request, index, max_tokens)

    monkeypatch.setattr(engine_module, "Sequence", second_fails)
    with pytest.raises(ValueError, match="injected"):
        engine.add_request("half", prompts[1], SamplingParams(max_tokens=3, n=2))
    monkeypatch.setattr(engine_module, "Sequence", real)
    assert engine.free_capacity()["waiting"] == 0 and not engine.has_unfinished()
    out = engine.generate([prompts[1]], _greedy(4))[0]
    assert out.token_ids == reference.greedy("llama", prompts[1], 4)


def test_the_callers_model_keeps_its_own_attention(model_dirs, reference, tokenizer, mixed_prompts):
    from transformers import AutoModelForCausalLM

    from bulkgen.engine import Engine

    prompt = mixed_prompts(seed=45, count=1, low=9, high=9)[0]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    before = model.config._attn_implementation
    engine = Engine(model, tokenizer)
    assert engine.generate([prompt], _greedy(5))[0].token_ids == reference.greedy("llama", prompt, 5)
    assert model.config._attn_implementation == before
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
    assert out[0, len(prompt) :].tolist() == reference.greedy("llama", prompt, 5)
