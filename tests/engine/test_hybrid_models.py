"""Hybrid models (Gated DeltaNet, Mamba-2 and short-conv layers beside paged attention) give transformers'
greedy tokens in mixed packed batches: each sequence's recurrent state lives in its own state slot.

Tiny random models of each architecture (bulkgen/lab/tiny_hybrid.py), fp32 CPU; the reference is
transformers' `generate` on each prompt alone.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny_hybrid import HYBRID_ARCHITECTURES, build_tiny_hybrid

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)

ARCHS = sorted(HYBRID_ARCHITECTURES)
LENGTHS = [600, 5, 37, 150, 12, 260]  # the 600-token prompt is prefilled in chunks of the 64-token budget
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: build_tiny_hybrid(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in LENGTHS]


def _greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _engine(path, **kwargs) -> Engine:
    return Engine.from_pretrained(str(path), device="cpu", **kwargs)


def _run_staggered(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Half the requests first, the rest after three steps (admitted beside running decodes)."""
    half = len(prompts) // 2
    results = {}
    for i in range(half):
        engine.add_request(str(i), prompts[i], params[i])
    for _ in range(3):
        results.update({o.request_id: o for o in engine.step()})
    for i in range(half, len(prompts)):
        engine.add_request(str(i), prompts[i], params[i])
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_mixed_chunked_preempted(arch, hybrid_dirs, prompts):
    """Prompts of 5 to 600 tokens admitted at different steps, a 64-token budget (chunked prefill), a
    KV cache too small for all at once (preemption), and one request with n=2 (its completions hold
    separate slots: both equal the reference)."""
    engine = _engine(
        hybrid_dirs[arch], max_num_seqs=6, max_num_batched_tokens=64, block_size=16, num_kv_blocks=48
    )
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=2 if i == 2 else 1) for i in range(6)]
    results = _run_staggered(engine, prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs[arch]).eval()
    for i, prompt in enumerate(prompts):
        want = _greedy(reference, prompt, MAX_TOKENS)
        got = [c.token_ids for c in results[str(i)].outputs]
        assert got == [want] * params[i].n, f"prompt {i} (len {len(prompt)})"
    records = engine.pop_step_records()
    assert max(r["prefill_tokens"] + r["decode_tokens"] for r in records) <= 64
    assert any(r["prefill_tokens"] and r["decode_tokens"] for r in records), (
        "no step mixed prefill and decode"
    )
    assert engine.stats()["preemptions"] > 0
    assert engine.runner.states.num_free == 6 and engine.block_manager.num_free_blocks == 48


def test_state_slots_limit_admission(hybrid_dirs, prompts):
    """Two state slots with room for six sequences: never more than two run, and tokens stay exact."""
    engine = _engine(hybrid_dirs["lfm2"], max_num_seqs=6, num_state_slots=2, max_num_batched_tokens=128)
    outs = engine.generate(prompts[1:5], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs["lfm2"]).eval()
    for prompt, out in zip(prompts[1:5], outs, strict=True):
        assert out.outputs[0].token_ids == _greedy(reference, prompt, MAX_TOKENS)
    assert max(r["num_seqs"] for r in engine.pop_step_records()) == 2
    assert engine.runner.states.num_free == 2


def test_prefix_caching_off_and_said(hybrid_dirs, prompts, caplog):
    """A repeated prompt reuses no block: a cached block cannot restore a recurrent state."""
    with caplog.at_level(logging.INFO, logger="bulkgen.engine"):
        engine = _engine(hybrid_dirs["qwen3_5"], max_num_seqs=2, block_size=8, admission="fifo")
    assert "prefix caching is off" in caplog.text
    assert engine.config.enable_prefix_caching is False
    outs = engine.generate([prompts[3]] * 3, SamplingParams(max_tokens=4, temperature=0))
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 0]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_seeded_sampling_is_batch_independent(hybrid_dirs, prompts):
    """The same seeded request gives the same tokens alone and among others (its state is its own)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    alone = _engine(hybrid_dirs["qwen3_next"], max_num_batched_tokens=64).generate([prompts[2]], params)
    crowd = _engine(hybrid_dirs["qwen3_next"], max_num_batched_tokens=64)
    other = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    outs = crowd.generate(prompts[1:5], [other, params, other, other])
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_abort_frees_state_slots(hybrid_dirs, prompts):
    engine = _engine(hybrid_dirs["granitemoehybrid"], max_num_seqs=4)
    for i, prompt in enumerate(prompts[1:4]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    assert engine.runner.states.num_free == 1
    engine.abort(["0", "1", "2"])
    assert engine.runner.states.num_free == 4
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=3, temperature=0))
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs["granitemoehybrid"]).eval()
    assert out[0].outputs[0].token_ids == _greedy(reference, prompts[1], 3)


def test_failed_step_is_an_error_not_wrong_tokens(hybrid_dirs, prompts, monkeypatch):
    """A forward that raises after some layers wrote their state: the next step refuses to run on the
    half-written slots; reset() recovers."""
    engine = _engine(hybrid_dirs["lfm2"], max_num_seqs=2)
    engine.add_request("a", prompts[1], SamplingParams(max_tokens=5, temperature=0))
    engine.step()
    attn = engine.model.model.layers[1].self_attn

    def boom(*args, **kwargs):
        raise RuntimeError("device fault")

    monkeypatch.setattr(attn, "forward", boom)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="state slot of sequence"):
        engine.step()
    engine.reset()
    out = engine.generate([prompts[1]], SamplingParams(max_tokens=5, temperature=0))
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs["lfm2"]).eval()
    assert out[0].outputs[0].token_ids == _greedy(reference, prompts[1], 5)


def test_model_still_generates_outside_the_engine(hybrid_dirs, prompts):
    """The wrapped mixers pass through when called without a packed step (the caller's own generate)."""
    engine = _engine(hybrid_dirs["falcon_h1"])
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs["falcon_h1"]).eval()
    assert _greedy(engine.model, prompts[1], 4) == _greedy(reference, prompts[1], 4)


def test_overlapped_steps_and_decode_graphs_keep_tokens_exact(hybrid_dirs, prompts):
    """Steps launched before the previous step's tokens are read (stand-in tokens read on the device)
    and decode steps through the graph path (run eagerly on CPU) leave each slot's state exact."""
    engine = _engine(
        hybrid_dirs["qwen3_next"], async_scheduling=True, cuda_graphs=True, max_num_batched_tokens=64
    )
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=2 if i == 1 else 1) for i in range(6)]
    results = _run_staggered(engine, prompts, params)
    reference = AutoModelForCausalLM.from_pretrained(hybrid_dirs["qwen3_next"]).eval()
    for i, prompt in enumerate(prompts):
        want = _greedy(reference, prompt, MAX_TOKENS)
        assert [c.token_ids for c in results[str(i)].outputs] == [want] * params[i].n, f"prompt {i}"
    assert engine.runner.graphs is not None and engine.runner.graphs.buckets


def test_an_unchecked_recurrent_layer_is_refused_by_name():
    """Bamba's Mamba mixer has the same cache API but no equality check here: refused at load, named."""
    import transformers

    from bulkgen.lab.tiny import build_tokenizer

    config = transformers.BambaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_expand=1,
    )
    model = transformers.BambaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"recurrent layers \['BambaMixer'\] that bulkgen has not checked"):
        Engine(model, build_tokenizer())
