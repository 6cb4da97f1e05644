"""Tensor parallel for the families of shard_families.py beyond test_tensor_parallel_architectures' matrix:
a Qwen2-MoE whose sparse layers (their block all-reduced once, shared expert included) sit beside a dense
MLP layer (reduced at its down_proj), a LoRA adapter on that model's MLP linears (the shared expert's
down_proj is row-parallel inside a block reduced once, so its adapter's shrink must stay a partial sum
too), Llama 4's experts packed along their last dimension, and CodeGen refused where the ranks do not
divide its fused projection's groups. Two gloo ranks on this machine, one torch thread each, fp32.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.parallel.layers import STYLES
from bulkgen.engine.parallel.rank_memory import rank_memory
from bulkgen.engine.parallel.shard_families import fit_modules
from bulkgen.engine.parallel.sharding import build_shard_model, parameters_on_meta
from bulkgen.lab.tiny import build_tiny_model
from bulkgen.lab.tiny_lora import save_random_adapter

ENGINE = dict(device="cpu", max_num_batched_tokens=64, block_size=8)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MLP = ("gate_proj", "up_proj", "down_proj", "o_proj")


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory, one_thread, rank_pool):
    """(single-process engine, two-rank engine) on a Qwen2-MoE whose layer 1 is a dense MLP, both serving
    a LoRA adapter on its attention output and MLP linears (the shared expert's among them)."""
    root = tmp_path_factory.mktemp("tp-qwen2-moe")
    path = build_tiny_model(root / "model", "qwen2_moe", seed=3, mlp_only_layers=[1])
    adapter = save_random_adapter(path, root / "adapter", 5, 4, 8, MLP)
    engines = [
        Engine.from_pretrained(str(path), tensor_parallel=tp, max_loras=1, launcher=rank_pool, **ENGINE)
        for tp in (1, 2)
    ]
    for engine in engines:
        engine.add_lora("mlp", str(adapter))
    yield engines
    engines[1].close()


def _tokens(engine: Engine, prompts: list[list[int]], lora: str | None) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY, lora=lora)
    results = {}
    while engine.has_unfinished():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    return results


@pytest.mark.parametrize("lora", [None, "mlp"])
def test_moe_blocks_beside_a_dense_layer_give_the_single_engines_tokens(qwen2_moe, tp_prompts, lora):
    single, sharded = qwen2_moe
    want = _tokens(single, tp_prompts, lora)
    assert _tokens(sharded, tp_prompts, lora) == want
    if lora:
        assert want != _tokens(single, tp_prompts, None)  # the adapter changes the tokens it is checked on


def test_llama4_experts_split_each_half_of_the_last_dimension():
    experts, hidden, inter, world = 3, 4, 6, 2
    packed = torch.arange(experts * hidden * 2 * inter, dtype=torch.float32).view(experts, hidden, 2 * inter)
    gate, up = packed.chunk(2, dim=-1)
    local = (experts, hidden, 2 * inter // world)
    shards = [
        STYLES["packed_rowwise"].read(packed, tuple(packed.shape), local, r, world) for r in range(world)
    ]
    assert all(s.shape == (experts, hidden, 2 * inter // world) for s in shards)
    assert torch.equal(torch.cat([s.chunk(2, dim=-1)[0] for s in shards], dim=-1), gate)
    assert torch.equal(torch.cat([s.chunk(2, dim=-1)[1] for s in shards], dim=-1), up)


def test_codegen_groups_that_do_not_split_over_the_ranks_are_refused():
    from transformers import AutoModelForCausalLM, CodeGenConfig

    config = CodeGenConfig(n_embd=64, n_head=8, n_layer=1, vocab_size=64, rotary_dim=4)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="interleaves q, v and k over 4 groups"):
        fit_modules(model, config, 8)
    fit_modules(model, config, 2)
    assert model.transformer.h[0].attn.qkv_proj.out_features == 96


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "llama4", "phi", "gpt_neox", "gptj", "codegen"])
def test_the_planners_rank_memory_is_a_loaded_ranks(arch, tiny_model):
    """`bulkgen plan`'s per-rank weights (rank_memory, from the config alone) are the parameters rank 0
    of two loads: GPT-NeoX's, GPT-J's and CodeGen's attention and MLPs split, Phi's head bias too."""
    from transformers import AutoConfig

    path = tiny_model(arch, seed=3)
    group = SimpleNamespace(rank=0, world=2, device=torch.device("cpu"))  # loading runs no collective
    model = build_shard_model(path, group, torch.float32)
    loaded = sum(p.numel() for p in model.parameters()) * 4
    planned = rank_memory(AutoConfig.from_pretrained(path), 2, torch.float32)["weight_bytes"]
    assert planned == loaded
