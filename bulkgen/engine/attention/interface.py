"""Packed, paged attention plugged into transformers through `AttentionInterface`.

The model sees one flat row of T tokens (batch dimension 1). Each layer writes its new K/V into the
paged cache (per layer [num_blocks, block_size, kv_heads, head_dim], the flash-attention paged layout,
through its KV group's block table: kv_layout) and every sequence attends only to its own tokens. The step's metadata is built once by the model
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

from bulkgen.engine.kv import kv_cache
from bulkgen.engine.kv.kv_cache import KVCache

ATTN_IMPLEMENTATION = "bulkgen_paged"
# SDPA's kernels in the order bulkgen lets it try them; a kernel that cannot take a call (flash with a
# mask, memory-efficient on CPU) is skipped for the next
SDPA_ORDER = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class LayerCaches:
    """The model's KV cache as its layers see it (kv_layout): each layer's K and V tensor (its slot's,
    shared with the same slot of the other groups), its group, and its attention as kernels take it."""

    k: list[KVCache]  # per layer [blocks + 1, block_size, kv_heads, k_dim] (kv_cache: float or FP8)
    v: list[KVCache]  # per layer [blocks + 1, block_size, kv_heads, v_dim]
    group: list[int]  # per layer
    layers: list  # per layer: layer_attention.LayerAttention


@dataclass
class StepContext:
    """Per-step attention state, shared by every layer of one forward pass; per KV group where the
    group's block table matters (cache rows and the backend's metadata)."""

    slots: list[torch.Tensor]  # per group: [T] cache row (block * block_size + offset) of each new token
    caches: LayerCaches
    backend: object  # attn_backends.Backend
    metas: list  # per group: that backend's per-step metadata
    positions: torch.Tensor | None = None  # [T] each token's position (for position-scaled queries)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    bulkgen_ctx: StepContext | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, Dk], key/value [1, Hkv, T, Dk/Dv] -> output [1, T, Hq, Dv]. The layer's window,
    chunk and soft-cap were learned at load (layer_attention.probe_layers); its sinks (`s_aux`) are
    the layer's own parameter, passed on as they come."""
    if bulkgen_ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} got no step context: it only runs inside "
            f"bulkgen.engine, on models whose layers pass forward kwargs down to attention"
        )
    ctx, idx = bulkgen_ctx, module.layer_idx
    caches = ctx.caches
    k_cache, v_cache, layer = caches.k[idx], caches.v[idx], caches.layers[idx]
    group = caches.group[idx]
    q = query[0].transpose(0, 1)  # [T, Hq, Dk]
    if layer.temperature is not None:
        q = _at_positions(q, ctx.positions, *layer.temperature)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
    k = kv_cache.write(k_cache, ctx.slots[group], k)  # as stored: FP8-rounded in an FP8 cache
    # MLA's latent cache: V is K's leading columns, already written with it (v_cache views k_cache)
    v = k[..., : layer.v_dim] if layer.latent else kv_cache.write(v_cache, ctx.slots[group], v)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ctx.backend.attend(q, k, v, k_cache, v_cache, ctx.metas[group], scale, layer.softcap, s_aux)
    return out.unsqueeze(0), None


def temperature_scale(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's query scale at each position (as transformers' Llama4TextAttention computes it)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def _at_positions(q: torch.Tensor, positions: torch.Tensor, floor_scale: float, attn_scale: float):
    """q scaled by the layer for row indices 0..T-1 (it counts positions along the row, one sequence
    per row) -> q scaled for each token's own position. Exact wherever both scales are 1 (positions
    below floor_scale - 1, every position of most prompts)."""
    rows = torch.arange(q.shape[0], device=q.device)
    factor = temperature_scale(positions, floor_scale, attn_scale) / temperature_scale(
        rows, floor_scale, attn_scale
    )
    return (q.float() * factor[:, None, None]).to(q.dtype)


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
