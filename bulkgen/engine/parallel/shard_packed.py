"""Tensor-parallel splits of the families whose transformers plans keep attention or the MLP whole on
every rank (`colwise_gather_output` then `rowwise_split_input`): OLMo 2/3 and MiniMax-M2 normalise q and
k with one RMSNorm over the whole projection (all heads together), Phi-3 packs q, k and v into one
`qkv_proj` of unequal parts, Phi-3 and GLM pack gate and up into one `gate_up_proj`. They split as vLLM
splits them, so each rank runs only its heads and its MLP rows:

- a whole-width norm runs on the rank's slice with the root-mean-square of the whole width: each rank's
  sum of squares is all-reduced (one small all-reduce per norm) and its slice of the norm weight applied.
  A KV head that several ranks hold (KV heads fewer than ranks) is counted once, by the first of them;
- a packed qkv gives each rank its heads' rows of each of q, k and v (a KV head replicated as for a
  separate k_proj: layers.PackedQKVParallel);
- a packed gate_up gives each rank its rows of each half (`packed_colwise`: layers.PackedColumnParallel).

Any other model whose plan uses those styles stays refused by sharding.tp_plan.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from bulkgen.engine.parallel.layers import COLUMN, layer_of

# model types whose gather-output / split-input plan entries are what this module splits
COVERED = {"olmo2", "olmo3", "minimax_m2", "phi3", "glm"}
_GATHER, _SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
# (their plan's style, the module's leaf name or None for any) -> the style it splits as here
_COVERED = {
    (_SPLIT_INPUT, None): "rowwise",
    (_GATHER, "qkv_proj"): "packed_qkv",  # with its widths: _packed_qkv
    (_GATHER, "gate_up_proj"): "packed_colwise",
    (_GATHER, "q_proj"): "colwise",
    (_GATHER, "k_proj"): "colwise",
    (_GATHER, "v_proj"): "colwise",
}
_NORMED = {(_GATHER, "q_proj"), (_GATHER, "k_proj")}  # projections normalised over their whole width
# norms whose weight multiplies after the cast back to the input dtype (the others multiply in float32)
_WEIGHT_AFTER_CAST = {"MiniMaxM2RMSNorm"}


def covered_plan(model: nn.Module, config, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with a covered family's gather-output and split-input entries as the splits above (its
    whole-width q/k norms added, split with their projections); any other model's plan unchanged, as is
    a vision-language model's (its build, vision_shards.py, does not swap in the whole-width norms)."""
    if getattr(config, "model_type", None) not in COVERED or config is not model.config:
        return plan
    out: dict[str, str] = {}
    for key, style in plan.items():
        leaf = key.rpartition(".")[2]
        ours = _COVERED.get((style, leaf), _COVERED.get((style, None), style))
        out[key] = _packed_qkv(model, key) if ours == "packed_qkv" else ours
        if (style, leaf) in _NORMED:  # its whole-width norm's weight splits with it
            out[f"{key[: -len(leaf)]}{leaf[0]}_norm"] = "colwise"
    return out


def _packed_qkv(model: nn.Module, key: str) -> str:
    """The packed_qkv style of the attention modules plan key `key` names (one layout for all layers),
    with the rank's query width and the head width (layers.PackedQKVParallel)."""
    pattern = re.compile(re.escape(key.rpartition(".")[0]).replace(r"\*", r"\d+") + "$")
    attention = next(m for name, m in model.named_modules() if pattern.match(name))
    heads = model.config.get_text_config().num_attention_heads  # the rank's own: the local config's
    return f"packed_qkv:{heads * attention.head_dim},{attention.head_dim}"


class WholeWidthRMSNorm(nn.Module):
    """An RMSNorm over a width the ranks split: its statistic is the whole width's (the ranks' sums of
    squares all-reduced), its weight the rank's slice. `counted`: whether this rank's slice adds to the
    sum (False for the second and later holders of a replicated KV head)."""

    def __init__(self, norm: nn.Module, group, width: int, counted: bool) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon
        self.group, self.width, self.counted = group, width, counted
        self.weight_after_cast = type(norm).__name__ in _WEIGHT_AFTER_CAST

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        squares = hidden.pow(2).sum(-1, keepdim=True)
        if not self.counted:
            squares = torch.zeros_like(squares)
        variance = self.group.all_reduce(squares) / self.width
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight_after_cast:
            return self.weight * hidden.to(dtype)
        return (self.weight * hidden).to(dtype)


def whole_width_norms(model: nn.Module, plan: dict[str, str], config, group) -> None:
    """Replace each q_norm / k_norm the plan splits (covered_plan) with its WholeWidthRMSNorm; `config`:
    the whole model's, whose KV head count says how many ranks hold each KV head."""

    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    holders = max(group.world // kv_heads, 1)
    for name, norm in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in ("q_norm", "k_norm") or layer_of(plan, name) is not COLUMN:
            continue
        replicas = holders if leaf == "k_norm" else 1
        width = norm.weight.shape[-1] * group.world // replicas
        counted = group.rank % replicas == 0
        owner = model.get_submodule(name.rpartition(".")[0])
        setattr(owner, leaf, WholeWidthRMSNorm(norm, group, width, counted))
