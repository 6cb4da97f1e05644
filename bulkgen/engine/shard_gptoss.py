"""gpt-oss under tensor parallel: the plan transformers' own config lacks, and the bias added once.

transformers' plan for gpt-oss names only its embedding (`embedding_rowwise`, which split_vocab does for a
plain nn.Embedding), so sharding.tp_plan takes this one instead, as vLLM splits the family:

- attention: q/k/v column-parallel with their biases, o_proj row-parallel (its bias zeroed on ranks > 0 by
  load_shards), and the per-head `sinks` (a learned logit in each head's softmax denominator) split with
  the heads, so rank r's attention reads its own heads' sinks;
- experts: `gate_up_proj` [experts, hidden, 2 * inter] holds gate and up INTERLEAVED along its last
  dimension (gate at even columns, up at odd ones). A contiguous slice of 2 * inter / world columns
  starting at an even column is whole (gate, up) pairs, so rank r's slice of the last dimension is its
  share of the intermediate units with the interleave kept; the bias [experts, 2 * inter] slices alike,
  `down_proj` [experts, inter, hidden] by the same units (its rows). The router stays whole on every rank
  (routing is computed from the whole hidden state), and the experts block's output is all-reduced.
  `down_proj_bias` [experts, hidden] is read whole and kept on rank 0 only (`add_bias_once`): every rank
  adds its routed experts' partial sums, so a bias on each would count world times.
"""

from __future__ import annotations

from torch import nn

GPT_OSS_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.sinks": "colwise",
    "layers.*.mlp.experts.gate_up_proj": "colwise",
    "layers.*.mlp.experts.gate_up_proj_bias": "colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}


def family_plan(config) -> dict[str, str] | None:
    """The tensor-parallel plan of a family whose transformers plan does not split its layers, or None."""
    return GPT_OSS_PLAN if getattr(config, "model_type", None) == "gpt_oss" else None


def add_bias_once(model: nn.Module, rank: int) -> None:
    """Zero the experts' down-projection bias on ranks > 0: the block's output is summed over the ranks."""
    if rank and family_plan(model.config) is not None:
        for module in model.modules():
            bias = getattr(module, "down_proj_bias", None)
            if isinstance(bias, nn.Parameter) and getattr(module, "gate_up_proj", None) is not None:
                bias.data.zero_()
