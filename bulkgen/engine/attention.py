"""Packed, paged attention plugged into transformers through `AttentionInterface`.

The model sees one flat row of T tokens (batch dimension 1). Each layer writes its new K/V into the
paged cache (per layer [num_blocks, block_size, kv_heads, head_dim], the flash-attention paged layout)
and every sequence attends only to its own tokens. The step's metadata is built once by the model
runner (see step_plan) and arrives in the `bulkgen_ctx` forward kwarg, so nothing per layer is
rebuilt and transformers builds no [T, T] mask (its mask factory early-exits for implementations it
does not know). How the attention itself is computed is the backend's business (attn_backends).

The implementation is switched on only inside `attention_scope`, around the engine's own forward
calls; the caller's model keeps its own attention implementation otherwise. The scope also pins the
order in which `scaled_dot_product_attention` picks its kernel (flash, memory-efficient, math: never
cuDNN, which builds an execution plan for every new shape and would do so for each new batch size and
context width, and each CUDA graph capture); which kernel each call site got is in
`attn_backends.SDPA_CHOICES`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "bulkgen_paged"
# SDPA's kernels in the order bulkgen lets it try them; a kernel that cannot take a call (flash with a
# mask, memory-efficient on CPU) is skipped for the next
SDPA_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class StepContext:
    """Per-step attention state, shared by every layer of one forward pass."""

    slots: torch.Tensor  # [T] cache row (block * block_size + offset) of each new token
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    backend: object  # attn_backends.Backend
    meta: object  # that backend's per-step metadata


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    bulkgen_ctx: StepContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> output [1, T, Hq, D]."""
    if bulkgen_ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} got no step context: it only runs inside "
            f"bulkgen.engine, on models whose layers pass forward kwargs down to attention"
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("bulkgen's paged attention has no logit soft-capping or attention sinks")
    ctx = bulkgen_ctx
    k_cache, v_cache = ctx.k_caches[module.layer_idx], ctx.v_caches[module.layer_idx]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, ctx.slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, ctx.slots, v)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ctx.backend.attend(query[0].transpose(0, 1), k, v, k_cache, v_cache, ctx.meta, scale)
    return out.unsqueeze(0), None


@contextmanager
def attention_scope(model: torch.nn.Module) -> Iterator[None]:
    """Route the model's attention to bulkgen for the duration of one engine forward call."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_IMPLEMENTATION
    try:
        with sdpa_kernel(SDPA_ORDER, set_priority=True):
            yield
    finally:
        config._attn_implementation = previous


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
