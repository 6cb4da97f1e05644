"""gpt-oss under tensor parallel: the plan transformers' own config lacks, and its MXFP4 experts read by slice.

transformers' plan for gpt-oss names only its embedding (`embedding_rowwise`, which VocabParallel does for a
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
  `down_proj_bias` [experts, hidden] is read whole and kept on rank 0 only (layers.FusedExpertsParallel,
  the experts' type): every rank adds its routed experts' partial sums, so a bias on each would count
  world times.

gpt-oss' MXFP4 checkpoints (the experts as `*_blocks` / `*_scales`) are read here too, each rank
dequantizing its slice (load_mxfp4_experts) before load_shards reads the float rest.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from bulkgen.engine.parallel.shard_base import materialize, safetensors_files

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


def splits_quantized(config) -> bool:
    """Whether tensor parallel reads this quantized checkpoint: gpt-oss' own MXFP4 (load_mxfp4_experts)."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant.quant_method
    return getattr(config, "model_type", None) == "gpt_oss" and method == "mxfp4"


def load_mxfp4_experts(model: nn.Module, path, rank: int, dtype, device) -> None:
    """Fill the experts' `gate_up_proj` and `down_proj` of an MXFP4 checkpoint with this rank's slice,
    dequantized to `dtype` by transformers' own function (as the single engine's load dequantizes the
    whole: e2m1 values times powers of two, exact in any float dtype, so both hold the same numbers).
    Each is stored as `*_blocks` [experts, out, in / 32, 16] (two e2m1 values a byte) and `*_scales`
    [experts, out, in / 32]; a rank reads only the rows or 32-wide groups its slice needs, so its peak is
    about its share. load_shards, which skips these names, then fills the rest."""
    if not splits_quantized(model.config):
        return
    from safetensors import safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    where = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            where.update(dict.fromkeys(handle.keys(), file))
    for blocks in sorted(name for name in where if name.endswith("_blocks")):
        name = blocks.removesuffix("_blocks")
        if name not in params or f"{name}_scales" not in where:
            raise ValueError(
                f"checkpoint at {path}: MXFP4 tensor {blocks} fills no expert weight of the model"
            )
        param = materialize(model, name, params, dtype, device)
        scales = f"{name}_scales"
        with safe_open(str(where[blocks]), "pt") as b, safe_open(str(where[scales]), "pt") as s:
            data = _dequantized_slice(
                name, b.get_slice(blocks), s.get_slice(scales), param.shape, rank, dtype
            )
        param.data.copy_(data)


def _dequantized_slice(name: str, blocks, scales, local: torch.Size, rank: int, dtype) -> torch.Tensor:
    """This rank's [experts, in, out] slice of one MXFP4 weight: an output slice (gate_up: whole (gate,
    up) pairs, as in the float checkpoint) reads its rows; an input slice (down) reads the 32-wide groups
    that hold its columns and trims to them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    experts, rows, groups, _ = blocks.get_shape()
    width_in, width_out = local[1], local[2]
    if local[0] != experts or rows % width_out or (groups * 32) % width_in:
        raise ValueError(
            f"MXFP4 weight {name}: blocks of shape {tuple(blocks.get_shape())} do not split into {tuple(local)}"
        )
    out0, in0 = rank * width_out if width_out < rows else 0, rank * width_in if width_in < groups * 32 else 0
    g0, g1 = in0 // 32, -(-(in0 + width_in) // 32)
    index = (slice(None), slice(out0, out0 + width_out), slice(g0, g1))
    whole = convert_moe_packed_tensors(blocks[index], scales[index], dtype=dtype)  # [experts, in, out]
    return whole[:, in0 - g0 * 32 : in0 - g0 * 32 + width_in]
