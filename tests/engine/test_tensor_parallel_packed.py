"""Whole-width q/k norms and packed projections on two gloo ranks (shard_packed.py): OLMo 3 and
MiniMax-M2 normalise q and k over all heads together, Phi-3 packs [q | k | v] and gate_up.

The matrix test (test_tensor_parallel_architectures.py) runs these families with two KV heads, one per
rank, and with the norm weights transformers initialises to ones. Here each model has ONE KV head, which
both ranks hold (so a k_norm that summed both ranks' squares would count it twice, and a packed qkv must
give both ranks the same k and v rows), and its q/k norm weights are random, so a rank that applied the
wrong slice of them would show.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.parallel.sharding import parameters_on_meta, tp_plan
from bulkgen.lab.tiny import build_tiny_model

ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8, num_kv_blocks=256)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)


def _random_norms(path: Path, fused_experts: bool = False) -> str:
    """Rewrite the checkpoint with random q/k norm weights (seeded). `fused_experts`: save the model's
    own parameter names (MiniMax-M2's fused experts) rather than transformers' per-expert layout."""
    if fused_experts:
        from transformers import AutoModelForCausalLM

        weights = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    else:
        weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    for name, tensor in weights.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            weights[name] = 1 + 0.5 * torch.randn(tensor.shape, generator=gen)
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors", {"format": "pt"})
    return str(path)


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    outs = engine.generate(prompts, PARAMS)
    logprobs = [entry["logprob"] for o in outs for entry in o.prompt_logprobs if entry]
    return [o.outputs[0].token_ids for o in outs], torch.tensor(logprobs)


@pytest.mark.parametrize("name", ["olmo3", "phi3", "minimax_m2"])
def test_one_kv_head_on_two_ranks_gives_the_single_engines_tokens(name, tmp_path, tp_prompts, one_thread):
    path = _random_norms(
        build_tiny_model(tmp_path, name, seed=3, num_key_value_heads=1), name == "minimax_m2"
    )
    tokens, logprobs = _run(Engine.from_pretrained(path, **ENGINE), tp_prompts)
    sharded = Engine.from_pretrained(path, tensor_parallel=2, **ENGINE)
    try:
        got, got_logprobs = _run(sharded, tp_prompts)
    finally:
        sharded.close()
    assert got == tokens
    assert (got_logprobs - logprobs).abs().max() < 1e-4


def test_olmo3_fp8_on_two_ranks_is_as_close_to_single_fp8_as_that_is_to_float(
    tmp_path, tp_prompts, one_thread
):
    """Online FP8 quantizes each rank's shard (sharding.py: row-parallel shards get their own scales, so
    close to, not equal to, single FP8); the whole-width norms stay float. Measured on these prompts,
    prompt logprobs' max / mean difference: two-rank FP8 off single FP8 0.053 / 0.014, single FP8 off
    float 0.083 / 0.017."""
    path = _random_norms(build_tiny_model(tmp_path, "olmo3", seed=3))
    _, float_logprobs = _run(Engine.from_pretrained(path, **ENGINE), tp_prompts)
    _, logprobs = _run(Engine.from_pretrained(path, quantize="fp8", **ENGINE), tp_prompts)
    sharded = Engine.from_pretrained(path, quantize="fp8", tensor_parallel=2, **ENGINE)
    try:
        _, got_logprobs = _run(sharded, tp_prompts)
    finally:
        sharded.close()
    sharding, quantizing = (got_logprobs - logprobs).abs(), (logprobs - float_logprobs).abs()
    assert sharding.max() < 0.1 and sharding.mean() <= 1.5 * quantizing.mean(), (sharding, quantizing)


def test_another_model_type_with_the_same_plan_stays_refused(tmp_path):
    """The gather-output styles split only for the families shard_packed knows: the same plan under a
    model type it does not cover is refused, naming the style."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(build_tiny_model(tmp_path, "olmo2", seed=3))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    assert tp_plan(model)["model.layers.*.self_attn.q_norm"] == "colwise"
    model.config.model_type = "not_covered"
    with pytest.raises(ValueError, match="colwise_gather_output"):
        tp_plan(model)


def _adapter_run(engine: Engine, prompts: list[list[int]], loras: list[str | None]) -> dict:
    """request id -> (greedy tokens, prompt logprobs) of each prompt with its adapter (or none)."""
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, PARAMS, lora=lora)
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            logprobs = [entry["logprob"] for entry in o.prompt_logprobs if entry]
            outs[o.request_id] = (o.outputs[0].token_ids, torch.tensor(logprobs))
    return outs


def test_phi3_lora_on_packed_projections_on_two_ranks(tmp_path, tp_prompts, one_thread):
    """An adapter on Phi-3's packed qkv_proj and gate_up_proj: each rank's B rows are its part of each of
    q, k, v (the one KV head on both) and of each half, as the base weight's (lora_tp.py)."""
    from bulkgen.lab.tiny_lora import save_random_adapter

    path = build_tiny_model(tmp_path / "phi3", "phi3", seed=3, num_key_value_heads=1)
    adapter = save_random_adapter(path, tmp_path / "lora", 5, 4, 8, ("qkv_proj", "gate_up_proj", "o_proj"))
    loras = [None, "a"] * (len(tp_prompts) // 2)
    single = Engine.from_pretrained(str(path), **ENGINE)
    single.add_lora("a", str(adapter))
    want, base = (
        _adapter_run(single, tp_prompts, loras),
        _adapter_run(single, tp_prompts, [None] * len(loras)),
    )
    assert all(want[i][0] != base[i][0] for i in ("1", "3", "5"))  # the adapter changes every such row
    sharded = Engine.from_pretrained(str(path), tensor_parallel=2, **ENGINE)
    try:
        sharded.add_lora("a", str(adapter))
        got = _adapter_run(sharded, tp_prompts, loras)
    finally:
        sharded.close()
    assert {i: tokens for i, (tokens, _) in got.items()} == {i: tokens for i, (tokens, _) in want.items()}
    assert max((got[i][1] - want[i][1]).abs().max() for i in want) < 1e-4
