"""Tensor-parallel splits of the families whose transformers plans keep attention or the MLP whole on
every rank (`colwise_gather_output` then `rowwise_split_input`): OLMo 2/3 and MiniMax-M2 normalise q and
k with one RMSNorm over the whole projection (all heads together), Phi-3 packs q, k and v into one
`qkv_proj` of unequal parts, Phi-3 and GLM pack gate and up into one `gate_up_proj`. They split as vLLM
splits them, so each rank runs only its heads and its MLP rows:

- a whole-width norm runs on the rank's slice with the root-mean-square of the whole width: each rank's
  sum of squares is all-reduced (one small all-reduce per norm) and its slice of the norm weight applied.
  A KV head that several ranks hold (KV heads fewer than ranks) is counted once, by the first of them;
- a packed qkv gives each rank its heads' rows of each of q, k and v (a KV head replicated as for a
  separate k_proj: sharding.shard_slice);
- a packed gate_up gives each rank its rows of each half (sharding's `packed_colwise`).

Any other model whose plan uses those styles stays refused by sharding.tp_plan.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from bulkgen.engine.parallel.shard_base import shard_slice, style_of

# model types whose gather-output / split-input plan entries are what this module splits
COVERED = {"olmo2", "olmo3", "minimax_m2", "phi3", "glm"}
_GATHER, _SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"
# norms whose weight multiplies after the cast back to the input dtype (the others multiply in float32)
_WEIGHT_AFTER_CAST = {"MiniMaxM2RMSNorm"}


class PackedQKV(str):
    """The plan style `packed_qkv`, carrying the rank's query width and the head width: the checkpoint's
    [q | k | v] shape alone does not say where q ends."""

    def __new__(cls, query_width: int, head_dim: int) -> PackedQKV:
        style = super().__new__(cls, "packed_qkv")
        style.query_width, style.head_dim = query_width, head_dim
        return style


def covered_plan(model: nn.Module, config, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with a covered family's gather-output and split-input entries as the splits above (its
    whole-width q/k norms added, split with their projections); any other model's plan unchanged, as is
    a vision-language model's (its build, vision_shards.py, does not swap in the whole-width norms)."""
    if getattr(config, "model_type", None) not in COVERED or config is not model.config:
        return plan
    out: dict[str, str] = {}
    for key, style in plan.items():
        leaf = key.rpartition(".")[2]
        if style == _SPLIT_INPUT:
            style = "rowwise"
        elif style == _GATHER and leaf == "qkv_proj":
            style = _packed_qkv(model, key)
        elif style == _GATHER and leaf == "gate_up_proj":
            style = "packed_colwise"
        elif style == _GATHER and leaf in ("q_proj", "k_proj"):
            style = "colwise"
            out[f"{key[: -len(leaf)]}{leaf[0]}_norm"] = "colwise"  # its whole-width norm's weight
        elif style == _GATHER and leaf == "v_proj":
            style = "colwise"
        out[key] = style
    return out


def _packed_qkv(model: nn.Module, key: str) -> PackedQKV:
    """The packed_qkv style of the attention modules plan key `key` names (one layout for all layers)."""
    pattern = re.compile(re.escape(key.rpartition(".")[0]).replace(r"\*", r"\d+") + "$")
    attention = next(m for name, m in model.named_modules() if pattern.match(name))
    heads = model.config.get_text_config().num_attention_heads  # the rank's own: the local config's
    return PackedQKV(heads * attention.head_dim, attention.head_dim)


def qkv_rows(view, full: tuple[int, ...], style: PackedQKV, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of a packed [q | k | v] checkpoint tensor (weight or bias): its query heads, and
    the KV heads its query heads read."""

    query = style.query_width * world
    kv = (full[0] - query) // 2
    kv_local = max(kv // style.head_dim // world, 1) * style.head_dim
    parts = []
    for start, width, local in (
        (0, query, style.query_width),
        (query, kv, kv_local),
        (query + kv, kv, kv_local),
    ):
        rows = shard_slice((width,), (local,), rank, world)[0] if width != local else slice(0, width)
        parts.append(view[start + rows.start : start + rows.stop])
    return torch.cat(parts, dim=0)


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
        if leaf not in ("q_norm", "k_norm") or style_of(plan, name) != "colwise":
            continue
        replicas = holders if leaf == "k_norm" else 1
        width = norm.weight.shape[-1] * group.world // replicas
        counted = group.rank % replicas == 0
        owner = model.get_submodule(name.rpartition(".")[0])
        setattr(owner, leaf, WholeWidthRMSNorm(norm, group, width, counted))
