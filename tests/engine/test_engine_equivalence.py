"""Greedy output of the packed, paged, continuously batched engine equals HF `generate` on each prompt alone."""

from __future__ import annotations

import pytest

from bulkgen.engine import SamplingParams
from bulkgen.lab.grouped import scheduler_for

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def _check(engine, reference, arch, prompts, max_tokens):
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert out.request_id == str(i)
        assert out.prompt_token_ids == prompt
        assert out.token_ids == reference.greedy(arch, prompt, max_tokens), f"prompt {i} (len {len(prompt)})"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_lengths_with_chunked_prefill(arch, make_engine, reference, mixed_prompts):
    """Prompts up to 3x the token budget: long ones are prefilled in chunks next to running decodes."""
    prompts = mixed_prompts(seed=1, count=10, low=1, high=150)
    engine = make_engine(arch, max_num_seqs=6, max_num_batched_tokens=48, block_size=8)
    _check(engine, reference, arch, prompts, max_tokens=10)
    records = engine.pop_step_records()
    assert max(r["prefill_tokens"] + r["decode_tokens"] for r in records) <= 48
    assert any(r["prefill_tokens"] and r["decode_tokens"] for r in records), (
        "no step mixed prefill and decode"
    )
    assert max(r["num_seqs"] for r in records) <= 6


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_hits_cache(arch, make_engine, reference, mixed_prompts):
    system = mixed_prompts(seed=2, count=1, low=40, high=40)[0]
    tails = mixed_prompts(seed=3, count=6, low=1, high=12)
    prompts = [system + t for t in tails] + [system + tails[0]]
    engine = make_engine(arch, max_num_seqs=2, block_size=8, admission="fifo")
    outs = _check(engine, reference, arch, prompts, max_tokens=6)
    cached = [o.metrics.num_cached_tokens for o in outs]
    assert cached[0] == 0
    assert all(c >= 40 for c in cached[1:]), cached  # the 5 full system-prompt blocks are reused
    assert cached[-1] == (len(prompts[-1]) - 1) // 8 * 8, "a repeated prompt reuses all its full blocks"
    assert engine.stats()["cached_prompt_tokens"] == sum(cached)


@pytest.mark.parametrize(
    "arch,policy", [("llama", "continuous"), ("mistral", "continuous"), ("qwen3", "static")]
)
def test_preemption_when_blocks_run_out(arch, policy, make_engine, reference, mixed_prompts):
    prompts = mixed_prompts(seed=4, count=8, low=10, high=40)
    engine = make_engine(
        arch,
        max_num_seqs=8,
        block_size=4,
        num_kv_blocks=24,
        enable_prefix_caching=False,
        scheduler=scheduler_for(policy),
    )
    outs = _check(engine, reference, arch, prompts, max_tokens=24)
    assert engine.stats()["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == engine.stats()["preemptions"]
    assert engine.block_manager.num_free_blocks == 24


def test_preemption_with_prefix_cache_and_string_prompts(make_engine, reference, tokenizer):
    texts = [f"Summarise item number {i}: " + "lorem ipsum " * (i + 1) for i in range(6)]
    engine = make_engine("qwen2", max_num_seqs=6, block_size=4, num_kv_blocks=40, max_num_batched_tokens=32)
    outs = engine.generate(texts, SamplingParams(max_tokens=20, temperature=0))
    for text, out in zip(texts, outs, strict=True):
        ids = tokenizer(text).input_ids
        assert out.token_ids == reference.greedy("qwen2", ids, 20)
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("admission", ["shortest_first", "fifo"])
def test_admission_orders_give_same_greedy_output(admission, make_engine, reference, mixed_prompts):
    prompts = mixed_prompts(seed=5, count=6, low=1, high=60)
    engine = make_engine("llama", max_num_seqs=3, admission=admission, max_num_batched_tokens=64)
    _check(engine, reference, "llama", prompts, max_tokens=8)


def test_bulk_system_prompt_is_computed_once(make_engine, reference, mixed_prompts):
    """One long system prompt over many rows: rows admitted after the first reuse its blocks, even
    when the prompt is longer than the token budget (chunked prefill commits blocks as it goes)."""
    system = mixed_prompts(seed=6, count=1, low=64, high=64)[0]
    prompts = [system + t for t in mixed_prompts(seed=7, count=8, low=2, high=10)]
    engine = make_engine("qwen2", max_num_batched_tokens=48, block_size=8)
    outs = _check(engine, reference, "qwen2", prompts, max_tokens=4)
    cached = sorted(o.metrics.num_cached_tokens for o in outs)
    assert cached[0] == 0 and all(c >= 48 for c in cached[1:]), cached
    stats = engine.stats()
    assert stats["prefill_tokens"] + stats["cached_prompt_tokens"] == sum(len(p) for p in prompts)
