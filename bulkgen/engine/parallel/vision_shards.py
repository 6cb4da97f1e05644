"""A vision-language model's tensor-parallel shard (tensor_parallel.load_shard hands such a checkpoint
here): its language model split as any decoder's, its encoder and projector whole on rank 0 and absent
elsewhere. Rank 0 alone runs the encoder; multimodal.splice broadcasts each step's image rows to the
other ranks, whose step plan says where they go (plan_codec.py).
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import torch
from torch import nn

from bulkgen.engine.features.hybrid_layers import find_mixers
from bulkgen.engine.features.multimodal import text_model
from bulkgen.engine.model.quantize import quantize_layers
from bulkgen.engine.parallel.layers import VOCAB
from bulkgen.engine.parallel.shard_hybrid import check_split_mixers
from bulkgen.engine.parallel.sharding import (
    add_all_reduces,
    load_shards,
    local_config,
    parameters_on_meta,
    tp_plan,
)


def build_vision_shard(
    path: str | Path, config, group, dtype: torch.dtype, quantize: str | None = None
) -> tuple[nn.Module, nn.Module]:
    """A vision-language model's language half, sharded like any decoder; rank 0 alone also loads the
    encoder and projector whole (the only rank that runs them: multimodal.splice sends their rows to the
    others), the other ranks drop them before any weight is read. Returns (its language model, the whole
    model): the runner drives the first, the VisionTower encodes with the second.
    `quantize`: the language model's decoder layers quantized as a text shard's are (the encoder and
    projector stay float, as in one process: quantize.quantize_layers converts decoder layers only)."""
    from transformers import AutoModelForImageTextToText

    local = deepcopy(config)
    local.text_config = local_config(config.get_text_config(), group.world)
    with parameters_on_meta():
        vlm = AutoModelForImageTextToText.from_config(local, dtype=dtype)
    vlm.config._name_or_path = str(path)
    fix_head_dim(vlm.get_decoder(), local.text_config)
    check_split_mixers(vlm, find_mixers(vlm))  # before any weight is read
    if group.rank:
        drop_encoder(vlm)
    plan = tp_plan(vlm)
    VOCAB.split(vlm, config.get_text_config(), group)
    load_shards(vlm, path, plan, group.rank, group.world, dtype, "cpu" if quantize else group.device)
    if quantize:
        quantize_layers(vlm, group.device, quantize)
    add_all_reduces(vlm, plan, group)  # on the modules the model runs: quantized ones replaced the float
    vlm = vlm.to(group.device).eval()
    return text_model(vlm), vlm


def fix_head_dim(decoder: nn.Module, local) -> None:
    """Attention modules that derive their head width as hidden_size // num_attention_heads (Qwen2.5-VL's
    text model) instead of reading `head_dim`: on a rank's share of the heads that width doubles, so their
    projections are rebuilt (on meta, filled at load) for the rank's heads at the model's true width."""
    width, heads, kv, hidden = (
        local.head_dim,
        local.num_attention_heads,
        local.num_key_value_heads,
        local.hidden_size,
    )
    for module in decoder.modules():
        if getattr(module, "head_dim", width) == width or not hasattr(module, "q_proj"):
            continue
        module.head_dim, module.scaling = width, width**-0.5
        for name, (into, out) in {
            "q_proj": (hidden, heads * width),
            "k_proj": (hidden, kv * width),
            "v_proj": (hidden, kv * width),
            "o_proj": (heads * width, hidden),
        }.items():
            old = getattr(module, name)
            bias = old.bias is not None
            setattr(module, name, nn.Linear(into, out, bias=bias, device="meta", dtype=old.weight.dtype))


def drop_encoder(vlm: torch.nn.Module) -> None:
    """Remove the encoder and projector of `vlm` (every module of its base model beside the language
    model): a tensor-parallel follower never runs them, so it neither builds their weights nor reads them."""
    decoder = vlm.get_decoder()
    for name, child in list(vlm.model.named_children()):
        if child is not decoder:
            delattr(vlm.model, name)
