"""Tensor-parallel plan of multi-head latent attention (DeepSeek-V2/V3/R1, Kimi K2, GLM-4.7-Flash,
Youtu-LLM), split by heads as vLLM splits it.

An MLA layer's heads are independent after the latent: the query projection (q_proj, or q_b_proj after
the low-rank q_a_proj) and kv_b_proj (rows per head [qk_nope | v]) split by output rows, so each rank
holds whole heads, and o_proj by input columns, its partial sums all-reduced. What produces the latent
(q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm) is read by every head, so it stays whole
on every rank, and so does the latent KV cache [c_kv, k_pe]: each rank caches every token's latent and
runs the absorbed attention (mla.py) on its heads, W_UK and W_UV taken from its kv_b_proj shard. The
softmax scale (qk_head_dim, DeepSeek's yarn mscale) does not depend on the head count.

DeepSeek-V3's and Youtu's transformers plans name no attention weights, and V2's and GLM-4.7-Flash's
mark kv_a_proj_with_mqa `mla_kv_a_proj`, which means replicated here: all take this plan.
"""

from __future__ import annotations

from torch import nn

from bulkgen.engine.attention.mla import find_mla

# the latent's projections and norms are left out: a module outside the plan loads whole, and one whose
# shape differed on a rank would be refused at load (layers.Unplanned) rather than sliced
ATTENTION_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
# DeepSeek's MoE layers' always-on experts, as DeepSeek-V3's plan splits them (GLM-4.7-Flash's plan omits them)
SHARED_EXPERTS_PLAN = {
    "layers.*.mlp.shared_experts.gate_proj": "colwise",
    "layers.*.mlp.shared_experts.up_proj": "colwise",
    "layers.*.mlp.shared_experts.down_proj": "rowwise",
}


def mla_plan(model: nn.Module, base: dict[str, str]) -> dict[str, str]:
    """`base` (the model's tensor-parallel plan, names from its decoder) with MLA attention split by
    heads where the model's layers are the latent MLA modules mla.py runs; `base` itself otherwise."""
    if not find_mla(model):
        return base
    plan = {key: style for key, style in base.items() if not key.startswith("layers.*.self_attn.")}
    return {**SHARED_EXPERTS_PLAN, **plan, **ATTENTION_PLAN}
