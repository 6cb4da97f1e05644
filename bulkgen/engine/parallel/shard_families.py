"""Tensor-parallel rules for families whose transformers plan does not say all of how they split: MoE blocks
with a shared expert (Qwen2-MoE, Llama 4), Llama 4's experts packed along their last dimension, and
Mixtral's per-expert checkpoint names (w1, w3, w2).

An MoE block with a shared expert is all-reduced once, at its output, as vLLM does: its routed experts and
its shared expert each leave partial sums of their column slices (the router and the shared expert's gate
run whole on every rank, from the replicated hidden state), and the block is linear in those partial sums
(`experts + sigmoid(gate(x)) * shared`), so summing the block's output over the ranks gives the whole
block's. Reducing the experts and the shared expert each as well would count them `world` times.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

FAMILIES = {"mixtral", "qwen2_moe", "llama4_text", "phi", "gpt_neox", "gptj", "codegen"}
# model_type -> plan entries (relative to the base model, as transformers' plans are) added to its own plan
PLANS: dict[str, dict[str, str]] = {
    "qwen2_moe": {
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    },
}
# plan entries that name a split bulkgen makes anyway: layers.VocabParallel splits a plain embedding by vocabulary
DROPPED = {"embedding_rowwise"}
# the MoE block classes reduced once at their output, by their module's class name
BLOCKS = {"Qwen2MoeSparseMoeBlock", "Llama4TextMoe"}

# legacy per-expert checkpoint names -> (fused parameter, which half of gate_up it fills: 0, 1, None)
EXPERT_NAMES = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # Mixtral's checkpoints: w1 gate, w3 up, w2 down
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


def fused_experts_plan(model: nn.Module, prefix: str) -> dict[str, str]:
    """The split of every fused-experts module under `prefix` (gate_up_proj [experts, 2 x inter, hidden],
    down_proj [experts, hidden, inter]), relative to the base model as transformers' plans are: each rank
    its rows of both halves of every expert's gate_up and the matching columns of its down_proj, the block
    reduced once. A parallel layer type, so bulkgen's own: transformers' plans named it until 5.24 and 5.25
    moved experts to its expert-parallel plan. A family's own plan, where it names them, comes first."""
    plan = {}
    for name, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
            continue
        standard = gate_up.dim() == down.dim() == 3 and gate_up.shape[1] == 2 * down.shape[2]
        inside = not prefix or name.startswith(f"{prefix}.")
        if not standard or gate_up.shape[2] != down.shape[1] or not inside:
            continue
        key = re.sub(r"\.\d+\.", ".*.", name[len(prefix) + 1 :] if prefix else name)
        plan.update(
            {f"{key}.gate_up_proj": "packed_colwise", f"{key}.down_proj": "rowwise", key: "moe_tp_experts"}
        )
    return plan


def family_plan(model_type: str, base: dict[str, str]) -> dict[str, str]:
    """`base` (a model's transformers plan) with its family's entries added and, for the families here,
    the vocabulary split of its embedding left to layers.VocabParallel."""
    if model_type not in FAMILIES:
        return base
    return {k: v for k, v in {**base, **PLANS.get(model_type, {})}.items() if v not in DROPPED}


def fit_modules(model: nn.Module, config, world: int) -> None:
    """Give the modules that size themselves from the hidden width rather than from the head count their
    rank's shape (GPT-NeoX, GPT-J and CodeGen attention and MLPs): their head size is `hidden_size //
    heads`, which the local config's divided head count would multiply by `world`."""
    head = config.hidden_size // config.num_attention_heads
    for module in model.modules():
        kind = type(module).__name__
        if kind in ("GPTJMLP", "CodeGenMLP"):
            _split_linear(module, "fc_in", world, rows=True)
            _split_linear(module, "fc_out", world, rows=False)
        elif kind in _ATTENTION:
            projections, output = _ATTENTION[kind]
            if kind == "CodeGenAttention" and module.mp_num % world:
                raise ValueError(
                    f"tensor_parallel={world}: CodeGen's qkv_proj interleaves q, v and k over {module.mp_num} "
                    "groups, which do not split over the ranks"
                )
            module.scaling = head**-0.5
            setattr(module, "head_size" if kind == "GPTNeoXAttention" else "head_dim", head)
            if kind == "GPTNeoXAttention":
                factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
                module.rotary_ndims = int(head * factor)
            for name in projections:
                _split_linear(module, name, world, rows=True)
            _split_linear(module, output, world, rows=False)


# attention class -> (its column-parallel projections, its row-parallel output). GPT-NeoX's fused q/k/v
# rows are laid out per head ([heads, 3, head_dim]) and CodeGen's per training shard ([mp_num, q|v|k,
# heads / mp_num, head_dim]), so a rank's contiguous rows are whole heads' q, k and v either way.
_ATTENTION = {
    "GPTNeoXAttention": (("query_key_value",), "dense"),
    "GPTJAttention": (("q_proj", "k_proj", "v_proj"), "out_proj"),
    "CodeGenAttention": (("qkv_proj",), "out_proj"),
}


def _split_linear(parent: nn.Module, name: str, world: int, rows: bool) -> None:
    """Replace linear `name` with one on meta holding 1/world of its output rows (`rows`) or input columns."""
    old = getattr(parent, name)
    inputs, outputs = old.in_features, old.out_features
    inputs, outputs = (inputs, outputs // world) if rows else (inputs // world, outputs)
    setattr(parent, name, nn.Linear(inputs, outputs, bias=old.bias is not None, device="meta"))


def base_prefix(model: nn.Module) -> str:
    """Where the base model sits in `model`: its `base_model_prefix`, or where that names no attribute
    (Llama4ForCausalLM says `language_model` and keeps it at `model`) its one child that is a model."""
    from transformers import PreTrainedModel

    if not model.base_model_prefix or hasattr(model, model.base_model_prefix):
        return model.base_model_prefix
    children = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    return children[0] if len(children) == 1 else model.base_model_prefix


def reduce_blocks(model: nn.Module, group) -> set[str]:
    """Register one all-reduce on each MoE block's output; the names of those blocks (what lies inside
    them is not reduced again: in_block)."""
    blocks = set()
    for name, module in model.named_modules():
        if type(module).__name__ in BLOCKS:
            module.register_forward_hook(_block_reduce(group))
            blocks.add(name)
    return blocks


def _block_reduce(group) -> Callable:
    def reduce(_module, _args, output):
        # Llama 4's block returns (hidden, router_logits): the router's logits are whole on every rank
        if isinstance(output, tuple):
            return (group.all_reduce(output[0]), *output[1:])
        return group.all_reduce(output)

    return reduce


def in_block(model: nn.Module, name: str) -> bool:
    """Whether module `name` of `model` lies in an MoE block reduced once at its output: its own partial
    sums (a row-parallel linear's, the experts', a LoRA adapter's shrink on such a linear:
    lora_tp.row_parallel_reduce) are then not reduced, the block's all-reduce sums them with the rest."""
    parts = name.split(".")
    return any(
        type(model.get_submodule(".".join(parts[:i]))).__name__ in BLOCKS for i in range(1, len(parts))
    )
